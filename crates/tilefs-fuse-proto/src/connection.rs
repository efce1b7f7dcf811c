//! The connection as a filesystem sees it: passthrough backing files and
//! notifications to the kernel.

use crate::abi;
use crate::dev;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{mpsc, Arc, Mutex};
use zerocopy::IntoBytes;

/// The connection, as the filesystem sees it: passthrough backing files
/// and notifications to the kernel. A transport other than /dev/fuse (a
/// virtqueue) has neither: backing files are refused and notifications
/// dropped there.
pub struct Connection {
    fd: Option<Arc<OwnedFd>>,
    notify: Mutex<Option<mpsc::Sender<Notice>>>,
}

enum Notice {
    InvalEntry(u64, Vec<u8>),
    InvalInode(u64, i64, i64),
    Delete(u64, u64, Vec<u8>),
}

/// A file the kernel reads and writes itself for opens answered with
/// FOPEN_PASSTHROUGH; unregistered when dropped.
pub struct BackingId {
    id: i32,
    fd: Arc<OwnedFd>,
}

impl BackingId {
    pub fn id(&self) -> i32 {
        self.id
    }
}

impl Drop for BackingId {
    fn drop(&mut self) {
        tilefs_sys::fuse_dev::backing_close(self.fd.as_fd(), self.id);
    }
}

impl Connection {
    /// The connection of a /dev/fuse descriptor.
    pub fn of_device(fd: Arc<OwnedFd>) -> Arc<Connection> {
        Arc::new(Connection {
            fd: Some(fd),
            notify: Mutex::new(None),
        })
    }

    /// A connection without a /dev/fuse descriptor (requests carried some
    /// other way): no passthrough, no notifications.
    pub fn without_device() -> Arc<Connection> {
        Arc::new(Connection {
            fd: None,
            notify: Mutex::new(None),
        })
    }

    /// Registers `file` as a backing file (needs CAP_SYS_ADMIN and
    /// FUSE_PASSTHROUGH).
    pub fn open_backing(&self, file: BorrowedFd<'_>) -> io::Result<BackingId> {
        let Some(dev) = &self.fd else {
            return Err(io::Error::from(io::ErrorKind::Unsupported));
        };
        let r = tilefs_sys::fuse_dev::backing_open(dev.as_fd(), file)?;
        Ok(BackingId { id: r, fd: dev.clone() })
    }

    fn queue(&self, n: Notice) {
        let Some(dev) = &self.fd else { return };
        let mut guard = self.notify.lock().unwrap();
        if guard.is_none() {
            // Notifications are written by a thread of their own: the
            // kernel may need locks that a request being answered holds.
            let (tx, rx) = mpsc::channel::<Notice>();
            let fd = dev.clone();
            let spawned = std::thread::Builder::new().name("fuse-notify".into()).spawn(move || {
                for n in rx {
                    if let Err(e) = send_notice(fd.as_fd(), &n) {
                        // ENOENT: nothing cached to invalidate.
                        if e.raw_os_error() != Some(libc::ENOENT) {
                            tracing::warn!("notifying the kernel failed: {e}");
                        }
                    }
                }
            });
            if spawned.is_err() {
                return;
            }
            *guard = Some(tx);
        }
        if let Some(tx) = guard.as_ref() {
            let _ = tx.send(n);
        }
    }

    /// Drops the kernel's cached entry `name` of directory `parent`.
    pub fn inval_entry(&self, parent: u64, name: &[u8]) {
        self.queue(Notice::InvalEntry(parent, name.to_vec()))
    }

    /// Drops the kernel's cached attributes of `ino`, and its cached data
    /// from `off` for `len` bytes (`len` 0: to the end; `off` -1: none).
    pub fn inval_inode(&self, ino: u64, off: i64, len: i64) {
        self.queue(Notice::InvalInode(ino, off, len))
    }

    /// Tells the kernel `child`, named `name` in `parent`, was deleted.
    pub fn delete(&self, parent: u64, child: u64, name: &[u8]) {
        self.queue(Notice::Delete(parent, child, name.to_vec()))
    }
}

fn send_notice(fd: BorrowedFd<'_>, n: &Notice) -> io::Result<()> {
    match n {
        Notice::InvalEntry(parent, name) => {
            let out = abi::NotifyInvalEntryOut {
                parent: *parent,
                namelen: name.len() as u32,
                flags: 0,
            };
            dev::write_message(fd, 0, abi::notify::INVAL_ENTRY, &[out.as_bytes(), name, &[0]])
        }
        Notice::InvalInode(ino, off, len) => {
            let out = abi::NotifyInvalInodeOut {
                ino: *ino,
                off: *off,
                len: *len,
            };
            dev::write_message(fd, 0, abi::notify::INVAL_INODE, &[out.as_bytes()])
        }
        Notice::Delete(parent, child, name) => {
            let out = abi::NotifyDeleteOut {
                parent: *parent,
                child: *child,
                namelen: name.len() as u32,
                padding: 0,
            };
            dev::write_message(fd, 0, abi::notify::DELETE, &[out.as_bytes(), name, &[0]])
        }
    }
}
