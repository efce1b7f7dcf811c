//! fanotify pre-content events (Linux >= 6.14): a group that is asked
//! before a marked file is opened or read, and answers allow or deny.
//!
//! Used to fill a placeholder on its first access while the reader waits.
//! Only what tilefs needs: a pre-content group, inode marks, events with
//! their descriptor, answers (deny with an errno), and who holds a file's
//! `flock` ([`flock_holders`]).

use rustix::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::io;

/// Asked before a marked file is opened (any open: read, mmap, exec).
pub const OPEN_PERM: u64 = 0x0001_0000;
/// Asked before a byte range of a marked file is read or written.
pub const PRE_ACCESS: u64 = 0x0010_0000;

const CLASS_PRE_CONTENT: u32 = 0x08;
const CLOEXEC: u32 = 0x01;
const UNLIMITED_QUEUE: u32 = 0x10;
const UNLIMITED_MARKS: u32 = 0x20;
const MARK_ADD: u32 = 0x01;
const MARK_REMOVE: u32 = 0x02;
const MARK_DONT_FOLLOW: u32 = 0x04;
const MARK_FILESYSTEM: u32 = 0x100;
const ALLOW: u32 = 0x01;
const DENY: u32 = 0x02;
const ERRNO_SHIFT: u32 = 24;
const METADATA_VERSION: u8 = 3;
const METADATA_LEN: usize = 24;
const INFO_RANGE: u8 = 6;

/// A pre-content fanotify group (its descriptor: the group lives while
/// any process holds a copy).
#[derive(Debug)]
pub struct Group(OwnedFd);

/// One permission event: its descriptor (read-only, raising no events of
/// its own) stays open until the event is answered, so that its number,
/// by which the kernel knows the event, is not given to another.
#[derive(Debug)]
pub struct Event {
    pub mask: u64,
    pub fd: OwnedFd,
    /// The process that asked (its thread group id).
    pub pid: i32,
    /// For a read or write: (offset, count).
    pub range: Option<(u64, u64)>,
}

/// How an event is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Allow,
    /// Fails the reader's call with this errno (EIO, EPERM, EBUSY,
    /// ETXTBSY, EAGAIN, ENOSPC, EDQUOT: what the kernel takes).
    Deny(i32),
}

impl Group {
    /// A group of the pre-content class (root only), with an unbounded
    /// queue and unbounded marks; its events' descriptors are read-only
    /// (a read through overlayfs reaches the file through the overlay's
    /// read-only private mount, where no writer can be opened).
    pub fn new() -> io::Result<Group> {
        // SAFETY: fanotify_init takes two integers and returns a new
        // descriptor or -1; the descriptor is owned from here on.
        let fd = unsafe {
            libc::fanotify_init(
                CLASS_PRE_CONTENT | CLOEXEC | UNLIMITED_QUEUE | UNLIMITED_MARKS,
                (libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC) as u32,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor this process owns.
        Ok(Group(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// The group of a descriptor handed down (a restarted filler's).
    pub fn from_fd(fd: OwnedFd) -> Group {
        Group(fd)
    }

    fn mark(&self, flags: u32, mask: u64, file: BorrowedFd<'_>) -> io::Result<()> {
        // SAFETY: a null path makes the kernel mark the object `file`
        // refers to; both descriptors are valid for the call.
        let r = unsafe { libc::fanotify_mark(self.0.as_raw_fd(), flags, mask, file.as_raw_fd(), std::ptr::null()) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Asks this group before `file`'s inode is opened or read (`mask`).
    pub fn mark_inode(&self, file: BorrowedFd<'_>, mask: u64) -> io::Result<()> {
        self.mark(MARK_ADD, mask, file)
    }

    /// Asks this group before the inode at `path` under `dir` (not
    /// following a final symlink) is opened or read: marked without being
    /// opened, so marking raises no event in another group.
    pub fn mark_at(&self, dir: BorrowedFd<'_>, path: &std::ffi::CStr, mask: u64) -> io::Result<()> {
        // SAFETY: `path` is a NUL-terminated string alive for the call;
        // both descriptors are valid for it.
        let r = unsafe {
            libc::fanotify_mark(
                self.0.as_raw_fd(),
                MARK_ADD | MARK_DONT_FOLLOW,
                mask,
                dir.as_raw_fd(),
                path.as_ptr(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Stops asking about `file`'s inode.
    pub fn unmark_inode(&self, file: BorrowedFd<'_>, mask: u64) -> io::Result<()> {
        self.mark(MARK_REMOVE, mask, file)
    }

    /// Waits for events and returns those that came (at least one, unless
    /// interrupted: then none).
    pub fn read_events(&self) -> io::Result<Vec<Event>> {
        let mut buf = vec![0u8; 64 * 1024];
        let n = match rustix::io::read(&self.0, &mut buf) {
            Ok(n) => n,
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        parse_events(&buf[..n])
    }

    /// Answers the event whose descriptor number is `fd` (from this
    /// process's read, or journaled by another that read it).
    pub fn answer_raw(&self, fd: RawFd, answer: Answer) -> io::Result<()> {
        let response = match answer {
            Answer::Allow => ALLOW,
            Answer::Deny(errno) => DENY | ((errno as u32 & 0xff) << ERRNO_SHIFT),
        };
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&fd.to_ne_bytes());
        bytes[4..].copy_from_slice(&response.to_ne_bytes());
        rustix::io::write(&self.0, &bytes)?;
        Ok(())
    }

    /// Answers `event` (its descriptor is closed after).
    pub fn answer(&self, event: Event, answer: Answer) -> io::Result<()> {
        self.answer_raw(event.fd.as_raw_fd(), answer)
    }
}

impl AsFd for Group {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl From<Group> for OwnedFd {
    fn from(g: Group) -> OwnedFd {
        g.0
    }
}

/// The events in `buf` (as read from a group), each descriptor owned.
fn parse_events(mut buf: &[u8]) -> io::Result<Vec<Event>> {
    let u32_at = |b: &[u8], i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |b: &[u8], i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let mut events = Vec::new();
    while buf.len() >= METADATA_LEN {
        let len = u32_at(buf, 0) as usize;
        let (vers, meta_len) = (buf[4], u16::from_ne_bytes([buf[6], buf[7]]) as usize);
        if vers != METADATA_VERSION || len < METADATA_LEN || len > buf.len() || meta_len < METADATA_LEN {
            return Err(io::Error::other(format!(
                "fanotify: an event of version {vers}, length {len} (expected version {METADATA_VERSION})"
            )));
        }
        let mask = u64_at(buf, 8);
        let fd = u32_at(buf, 16) as i32;
        let pid = u32_at(buf, 20) as i32;
        // Information records follow: the range of a read or write.
        let mut range = None;
        let mut info = &buf[meta_len..len];
        while info.len() >= 4 {
            let (kind, ilen) = (info[0], u16::from_ne_bytes([info[2], info[3]]) as usize);
            if ilen < 4 || ilen > info.len() {
                break;
            }
            if kind == INFO_RANGE && ilen >= 24 {
                range = Some((u64_at(info, 8), u64_at(info, 16)));
            }
            info = &info[ilen..];
        }
        buf = &buf[len..];
        if fd < 0 {
            // An overflow of the queue carries no descriptor (the queue
            // is unlimited: not expected).
            continue;
        }
        // SAFETY: the kernel installed this descriptor in our table for
        // this event; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        events.push(Event { mask, fd, pid, range });
    }
    Ok(events)
}

/// Whether the filesystem of `path` takes pre-content marks: the kernel
/// knows them (>= 6.14), this process may make such a group (root), and
/// the filesystem allows them (ext4, xfs, btrfs do; tmpfs and overlayfs
/// refuse with EOPNOTSUPP). The error says why not.
pub fn supports_pre_content(path: &std::path::Path) -> io::Result<()> {
    let group = Group::new()?;
    let dir = rustix::fs::open(
        path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    // A filesystem mark is what the kernel checks the filesystem for; it
    // goes with the group, at once.
    group.mark(MARK_ADD | MARK_FILESYSTEM, PRE_ACCESS, dir.as_fd())
}

/// The processes holding a `flock` on the inode (`dev`, `ino`), as
/// `/proc/locks` lists them (waiters not counted).
pub fn flock_holders(dev: u64, ino: u64) -> io::Result<Vec<i32>> {
    let want = format!("{:02x}:{:02x}:{ino}", rustix::fs::major(dev), rustix::fs::minor(dev));
    Ok(parse_flock_holders(&std::fs::read_to_string("/proc/locks")?, &want))
}

fn parse_flock_holders(locks: &str, inode: &str) -> Vec<i32> {
    locks
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace().skip(1);
            if w.next()? != "FLOCK" {
                return None; // a POSIX lock, or "->": a waiter
            }
            let pid = w.nth(2)?.parse().ok()?;
            (w.next()? == inode).then_some(pid)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_parsed_and_hostile_lengths_refused() {
        let mut ev = Vec::new();
        ev.extend_from_slice(&48u32.to_ne_bytes());
        ev.extend_from_slice(&[METADATA_VERSION, 0]);
        ev.extend_from_slice(&(METADATA_LEN as u16).to_ne_bytes());
        ev.extend_from_slice(&PRE_ACCESS.to_ne_bytes());
        ev.extend_from_slice(&(-1i32).to_ne_bytes()); // no descriptor: skipped
        ev.extend_from_slice(&7i32.to_ne_bytes());
        ev.extend_from_slice(&[INFO_RANGE, 0]);
        ev.extend_from_slice(&24u16.to_ne_bytes());
        ev.extend_from_slice(&[0; 4]);
        ev.extend_from_slice(&5u64.to_ne_bytes());
        ev.extend_from_slice(&9u64.to_ne_bytes());
        assert!(parse_events(&ev).unwrap().is_empty());
        let mut bad = ev.clone();
        bad[0] = 200; // longer than what was read
        assert!(parse_events(&bad).is_err());
        let mut bad = ev;
        bad[4] = 2;
        assert!(parse_events(&bad).is_err());
    }

    #[test]
    fn flock_holders_are_read_from_proc_locks() {
        let locks = "1: FLOCK  ADVISORY  WRITE 13357 fe:00:5514269 0 EOF\n\
                     1: -> FLOCK  ADVISORY  WRITE 99 fe:00:5514269 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 7 fe:00:5514269 0 EOF\n\
                     3: FLOCK  ADVISORY  READ 12 fe:00:551426 0 EOF\n\
                     garbage\n";
        assert_eq!(parse_flock_holders(locks, "fe:00:5514269"), vec![13357]);
        // And the kernel's own list: this process's lock is found.
        let path = std::env::temp_dir().join(format!("tilefs-flock-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive).unwrap();
        let st = rustix::fs::fstat(&f).unwrap();
        let me = rustix::process::getpid().as_raw_nonzero().get();
        assert!(flock_holders(st.st_dev, st.st_ino).unwrap().contains(&me));
    }
}
