//! A filesystem context of the new mount API (fsopen/fsconfig/fsmount) that
//! keeps the kernel's own explanation of a refusal: every failed `fsconfig`
//! leaves messages in the context's log, which are read back into the error.

use crate::MountError;
use rustix::fd::{AsFd, OwnedFd};
use rustix::io::Errno;
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};
use std::ffi::OsStr;

pub(crate) struct FsContext {
    fd: OwnedFd,
    fstype: &'static str,
}

impl FsContext {
    /// `fsopen(fstype)`, with the two refusals users meet named plainly.
    pub(crate) fn open(fstype: &'static str) -> Result<FsContext, MountError> {
        match rustix::mount::fsopen(fstype, FsOpenFlags::FSOPEN_CLOEXEC) {
            Ok(fd) => Ok(FsContext { fd, fstype }),
            Err(e) => Err(open_error(fstype, e)),
        }
    }

    pub(crate) fn set_string(&self, key: &str, value: impl AsRef<OsStr>) -> Result<(), MountError> {
        let value = value.as_ref();
        rustix::mount::fsconfig_set_string(&self.fd, key, value)
            .map_err(|e| self.error(format!("{key}={}", value.to_string_lossy()), e))
    }

    pub(crate) fn set_flag(&self, key: &str) -> Result<(), MountError> {
        rustix::mount::fsconfig_set_flag(&self.fd, key).map_err(|e| self.error(key.to_string(), e))
    }

    pub(crate) fn set_fd(&self, key: &str, fd: impl AsFd, what: &str) -> Result<(), MountError> {
        rustix::mount::fsconfig_set_fd(&self.fd, key, fd).map_err(|e| self.error(format!("{key}={what}"), e))
    }

    /// Creates the superblock (where the kernel opens the layers or the
    /// image and checks them).
    pub(crate) fn create(&self) -> Result<(), MountError> {
        // Some refusals (overlayfs's "workdir and upperdir must reside under
        // the same mount", say) reach only the kernel log, not the
        // context's: read what the kernel logged meanwhile too.
        let kmsg = KmsgCursor::at_end();
        rustix::mount::fsconfig_create(&self.fd).map_err(|e| {
            let mut err = self.error("creating the filesystem".into(), e);
            if let MountError::Kernel { log, .. } = &mut err {
                if log.is_empty() {
                    *log = kmsg.map(|k| k.lines_of(self.fstype)).unwrap_or_default();
                }
            }
            err
        })
    }

    /// A detached mount of the created filesystem: attached nowhere until
    /// `move_mount`, gone when its fd is closed.
    pub(crate) fn fsmount(&self, attrs: MountAttrFlags) -> Result<OwnedFd, MountError> {
        rustix::mount::fsmount(&self.fd, FsMountFlags::FSMOUNT_CLOEXEC, attrs)
            .map_err(|e| self.error("fsmount".into(), e))
    }

    /// Drains the context's log (messages the kernel left for us).
    pub(crate) fn take_log(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // The log holds at most 8 messages; a bound keeps a misbehaving
        // kernel from looping us.
        for _ in 0..64 {
            match rustix::io::read(&self.fd, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let msg = String::from_utf8_lossy(&buf[..n]).trim_end().to_string();
                    // "e overlay: ...", "w ...", "i ...": keep the text.
                    let msg = match msg.as_bytes() {
                        [b'e' | b'w' | b'i', b' ', ..] => msg[2..].to_string(),
                        _ => msg,
                    };
                    out.push(msg);
                }
            }
        }
        out
    }

    fn error(&self, step: String, errno: Errno) -> MountError {
        MountError::Kernel {
            fstype: self.fstype,
            step,
            errno,
            log: self.take_log(),
        }
    }
}

/// A position in the kernel log (/dev/kmsg, readable by root), to read
/// what was logged after it.
struct KmsgCursor(OwnedFd);

impl KmsgCursor {
    fn at_end() -> Option<KmsgCursor> {
        let fd = rustix::fs::open(
            "/dev/kmsg",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok()?;
        rustix::fs::seek(&fd, rustix::fs::SeekFrom::End(0)).ok()?;
        Some(KmsgCursor(fd))
    }

    /// The messages logged since, by `fstype` (`overlayfs: ...`,
    /// `erofs ...: ...`), without their prefix. Bounded: a busy log cannot
    /// keep us reading.
    fn lines_of(&self, fstype: &str) -> Vec<String> {
        let prefix = if fstype == "overlay" { "overlayfs" } else { fstype };
        let mut out = Vec::new();
        let mut buf = [0u8; 8192];
        for _ in 0..256 {
            let n = match rustix::io::read(&self.0, &mut buf) {
                Ok(n) if n > 0 => n,
                // EAGAIN: nothing more; EPIPE: records were overwritten.
                Err(Errno::PIPE) => continue,
                _ => break,
            };
            let rec = String::from_utf8_lossy(&buf[..n]);
            // "PRIO,SEQ,TIME,FLAGS;MESSAGE\n" (continuation lines follow).
            let Some(msg) = rec.split_once(';').map(|(_, m)| m.lines().next().unwrap_or("").trim()) else {
                continue;
            };
            if let Some(rest) = msg.strip_prefix(prefix) {
                let text = rest.split_once(": ").map_or(rest, |(_, t)| t).trim();
                if !text.is_empty() && out.len() < 8 {
                    out.push(text.to_string());
                }
            }
        }
        out
    }
}

pub(crate) fn open_error(fstype: &'static str, e: Errno) -> MountError {
    match e {
        Errno::NODEV => MountError::Unsupported(format!("the kernel has no {fstype} filesystem")),
        Errno::PERM | Errno::ACCESS => {
            MountError::NotPermitted(format!("mounting {fstype} needs privilege (CAP_SYS_ADMIN)"))
        }
        Errno::NOSYS => MountError::Unsupported("the kernel has no new mount API (fsopen, Linux 5.2 or later)".into()),
        e => MountError::Kernel {
            fstype,
            step: "fsopen".into(),
            errno: e,
            log: Vec::new(),
        },
    }
}
