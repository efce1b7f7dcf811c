//! The requests on names and directories: LOOKUP, the creations (MKNOD,
//! MKDIR, SYMLINK, CREATE), LINK, and OPENDIR, READDIR and FSYNCDIR.
//! UNLINK, RMDIR and RENAME are answered by [`super::names`] directly.

use super::names::NewEntry;
use super::serve::{answer, reopen_dir};
use super::upper::{S_IFDIR, S_IFMT, S_IFREG};
use super::{e, Handle, OverlayFs, R};
use crate::lower::FOREVER;
use rustix::fs::fsync;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tilefs_fuse_proto::abi::{self, fopen};
use tilefs_fuse_proto::{DirBuf, Entry, Open, Reply};

impl OverlayFs {
    /// The node of `name` in `parent`, if there is one, counted as looked up.
    fn lookup(&self, parent: u64, name: &[u8]) -> R<Option<u64>> {
        match self.find(parent, name)? {
            None => Ok(None),
            Some(f) => self.node_for(parent, name, &f).map(Some),
        }
    }

    pub(super) fn op_lookup(&self, parent: u64, name: &[u8], reply: Reply<'_>) {
        match self.lookup(parent, name) {
            Ok(Some(child)) => self.reply_entry(child, reply),
            Ok(None) => reply.entry(&Entry {
                nodeid: 0,
                entry_ttl: FOREVER,
                ..Entry::default()
            }),
            Err(x) => reply.error(x),
        }
    }

    /// MKDIR, SYMLINK and MKNOD: `name` made in `parent` for the caller
    /// `who`, answered with its entry.
    pub(super) fn op_make(
        &self,
        who: (u32, u32),
        parent: u64,
        name: &[u8],
        what: NewEntry<'_>,
        mode: u32,
        reply: Reply<'_>,
    ) {
        match self.create(who, parent, name, what, mode, false) {
            Ok((child, _)) => self.reply_entry(child, reply),
            Err(x) => reply.error(x),
        }
    }

    /// A file when `mode` says a regular file or no type at all, else a
    /// special file.
    pub(super) fn op_mknod(&self, who: (u32, u32), parent: u64, name: &[u8], mode: u32, rdev: u32, reply: Reply<'_>) {
        let what = if mode & S_IFMT == S_IFREG || mode & S_IFMT == 0 {
            NewEntry::File
        } else {
            NewEntry::Special(u64::from(rdev))
        };
        let mode = if mode & S_IFMT == 0 { mode | S_IFREG } else { mode };
        self.op_make(who, parent, name, what, mode, reply)
    }

    /// CREATE, or with `tmpfile` an unnamed file (O_TMPFILE): made and
    /// opened at once.
    pub(super) fn op_create(
        &self,
        who: (u32, u32),
        parent: u64,
        name: &[u8],
        mode: u32,
        tmpfile: bool,
        reply: Reply<'_>,
    ) {
        let made = if tmpfile {
            self.tmpfile(who, parent, mode).map(|(c, f)| (c, Some(f)))
        } else {
            self.create(who, parent, name, NewEntry::File, S_IFREG | mode, true)
        };
        match made {
            Ok((child, Some(f))) => match self.entry(child) {
                Ok(en) if self.no_open.load(Ordering::Relaxed) => {
                    // Once the kernel knows OPEN is not answered, it sends
                    // no RELEASE for a created file either: its I/O names
                    // the node (the first creates still get a RELEASE, of
                    // handle 0, which releases nothing).
                    self.unopened_keep(child, Handle::Upper(Arc::new(f)));
                    reply.create(
                        &en,
                        Open {
                            fh: 0,
                            flags: fopen::KEEP_CACHE,
                            backing_id: 0,
                        },
                    )
                }
                Ok(en) => reply.create(&en, self.opened(child, Handle::Upper(Arc::new(f)))),
                Err(x) => {
                    self.nodes().forget(child, 1);
                    reply.error(x)
                }
            },
            Ok((child, None)) => {
                self.nodes().forget(child, 1);
                reply.error(libc::EIO)
            }
            Err(x) => reply.error(x),
        }
    }

    pub(super) fn op_link(&self, node: u64, newparent: u64, newname: &[u8], reply: Reply<'_>) {
        match self.link(node, newparent, newname) {
            Ok(()) => self.reply_entry(node, reply),
            Err(x) => reply.error(x),
        }
    }

    /// The listing is taken at the first READDIR (see [`Handle::Dir`]).
    pub(super) fn op_opendir(&self, reply: Reply<'_>) {
        let (fh, _) = self.add_handle(Handle::Dir(Mutex::new(None)));
        reply.open(Open {
            fh,
            flags: fopen::CACHE_DIR | fopen::KEEP_CACHE,
            backing_id: 0,
        })
    }

    pub(super) fn op_readdir(&self, id: u64, fh: u64, offset: u64, size: u32, plus: bool, reply: Reply<'_>) {
        let Some(h) = self.handle_of(fh) else {
            return reply.error(libc::EBADF);
        };
        let Handle::Dir(snap) = &*h else {
            return reply.error(libc::EBADF);
        };
        let list = {
            let mut s = snap.lock().unwrap_or_else(|e| e.into_inner());
            if s.is_none() || offset == 0 {
                match self.listing(id) {
                    Ok(l) => *s = Some(Arc::new(l)),
                    Err(x) => return reply.error(x),
                }
            }
            s.clone().expect("set above")
        };
        let (ino, parent_ino) = {
            let nodes = self.nodes();
            let Some(n) = nodes.get(id) else {
                return reply.error(libc::ENOENT);
            };
            let p = n.primary().and_then(|(p, _)| nodes.get(p)).map_or(n.ino, |p| p.ino);
            (n.ino, p)
        };
        let mut buf = DirBuf::new(size);
        let dir_type = S_IFDIR >> 12;
        for i in offset..(list.len() as u64 + 2) {
            let full = match i {
                0 | 1 => {
                    let (name, ino): (&[u8], u64) = if i == 0 { (b".", ino) } else { (b"..", parent_ino) };
                    if plus {
                        // Not counted as lookups by the kernel.
                        let en = Entry {
                            attr: abi::Attr {
                                ino,
                                mode: S_IFDIR,
                                ..Default::default()
                            },
                            ..Entry::default()
                        };
                        buf.add_plus(&en, i + 1, dir_type, name)
                    } else {
                        buf.add(ino, i + 1, dir_type, name)
                    }
                }
                _ => {
                    let l = &list[(i - 2) as usize];
                    if plus {
                        let Ok(Some(child)) = self.lookup(id, &l.name) else {
                            continue;
                        };
                        match self.entry(child) {
                            Ok(en) => {
                                let full = buf.add_plus(&en, i + 1, (en.attr.mode & S_IFMT) >> 12, &l.name);
                                if full {
                                    self.nodes().forget(child, 1);
                                }
                                full
                            }
                            Err(_) => {
                                self.nodes().forget(child, 1);
                                continue;
                            }
                        }
                    } else {
                        buf.add(l.ino, i + 1, l.typ, &l.name)
                    }
                }
            };
            if full {
                break;
            }
        }
        reply.data(buf.as_bytes())
    }

    /// Syncs the directory's upper directory, if it has one.
    pub(super) fn op_fsyncdir(&self, id: u64, reply: Reply<'_>) {
        match self.dir_fd(id) {
            Ok(Some(d)) => {
                tilefs_fuse_proto::may_block();
                answer(reopen_dir(&*d).and_then(|f| fsync(&f)).map_err(e), reply)
            }
            Ok(None) => reply.ok(),
            Err(x) => reply.error(x),
        }
    }
}
