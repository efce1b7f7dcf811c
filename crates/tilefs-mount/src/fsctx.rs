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
        rustix::mount::fsconfig_create(&self.fd).map_err(|e| self.error("creating the filesystem".into(), e))
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
