//! The upper directory: where a writable mount keeps its changes, in
//! overlayfs's format so that the kernel's overlay reads what we write.
//!
//! - A file, directory or link of the merged tree that differs from the
//!   image is a real entry at its path.
//! - A deleted image entry is a whiteout: a character device 0/0 (which
//!   Linux lets unprivileged users make since 5.8).
//! - A directory that hides the image's directory of that name is opaque:
//!   xattr `overlay.opaque` = `y`; one moved away from its image path says
//!   where it came from: `overlay.redirect` = the absolute path in the
//!   image. The namespace is `trusted.` when the server is root (the
//!   kernel overlay's own), `user.` otherwise (overlayfs's `userxattr`).
//!   An xattr of that namespace set by a user is stored escaped
//!   (`overlay.overlay.NAME`), as overlayfs does.
//! - Without privilege, what the server cannot apply is recorded in
//!   `user.containers.override_stat` = `UID:GID:MODE[:TYPE]` (the
//!   containers/storage convention, read by fuse-overlayfs too): owners it
//!   may not give, the exact mode (on disk the server keeps read and write
//!   access for itself), and for devices, and symlinks or special files
//!   owned by someone else, the type: those are stored as regular files (a
//!   symlink's holds its target). xattrs it may not set (`trusted.*`,
//!   `security.*`) are kept as `user.tilefs.x.NAME`.
//!
//! Every access goes through descriptors below the upper root with
//! symlinks never followed, so a symlink planted in the upper directory
//! cannot lead anywhere outside it.

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) const S_IFMT: u32 = libc::S_IFMT;
pub(crate) const S_IFDIR: u32 = libc::S_IFDIR;
pub(crate) const S_IFREG: u32 = libc::S_IFREG;
pub(crate) const S_IFLNK: u32 = libc::S_IFLNK;

pub(crate) use tilefs_image::upper::{Override, KEPT_PREFIX, OVERRIDE};

/// The xattr namespace overlayfs's markers live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ns {
    Trusted,
    User,
}

impl Ns {
    pub(crate) fn prefix(self) -> &'static [u8] {
        match self {
            Ns::Trusted => b"trusted.overlay.",
            Ns::User => b"user.overlay.",
        }
    }

    fn key(self, what: &str) -> CString {
        let mut k = self.prefix().to_vec();
        k.extend_from_slice(what.as_bytes());
        CString::new(k).expect("no NUL")
    }
}

/// One `UID:GID:LEN` range of a uid or gid mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdRange {
    /// First id as stored (in the image and the upper directory).
    pub(crate) stored: u32,
    /// First id as the kernel sees it.
    pub(crate) shown: u32,
    pub(crate) len: u32,
}

/// Ids as stored, translated to the ids the kernel sees and back
/// (`-o uidmapping=`, `gidmapping=`). Empty: no translation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct IdMap(pub(crate) Vec<IdRange>);

/// The id the kernel shows for ids no mapping covers.
const OVERFLOW_ID: u32 = 65534;

impl IdMap {
    /// Parses `A:B:N[:A:B:N...]` (ranges may also be separated by `,`
    /// when given as one option value), or `none`.
    pub(crate) fn parse(s: &str) -> Result<IdMap, String> {
        // `none`: ids shown as stored (no translation; a user's writable
        // mount of root's image otherwise defaults to 0:UID:1).
        if s == "none" {
            return Ok(IdMap::default());
        }
        let nums: Result<Vec<u32>, _> = s.split([':', ',']).map(|n| n.trim().parse::<u32>()).collect();
        let nums = nums.map_err(|_| format!("{s:?}: expected STORED:SHOWN:LEN triples of numbers"))?;
        if nums.is_empty() || nums.len() % 3 != 0 {
            return Err(format!("{s:?}: expected STORED:SHOWN:LEN triples"));
        }
        let mut v = Vec::new();
        for t in nums.chunks(3) {
            if t[2] == 0 || t[0].checked_add(t[2] - 1).is_none() || t[1].checked_add(t[2] - 1).is_none() {
                return Err(format!("{s:?}: range {}:{}:{} is empty or overflows", t[0], t[1], t[2]));
            }
            v.push(IdRange {
                stored: t[0],
                shown: t[1],
                len: t[2],
            });
        }
        Ok(IdMap(v))
    }

    /// The id the kernel sees for a stored id.
    pub(crate) fn show(&self, id: u32) -> u32 {
        if self.0.is_empty() {
            return id;
        }
        self.0
            .iter()
            .find(|r| id >= r.stored && id - r.stored < r.len)
            .map_or(OVERFLOW_ID, |r| r.shown + (id - r.stored))
    }

    /// The stored id for an id the kernel gave; None if unmapped.
    pub(crate) fn store(&self, id: u32) -> Option<u32> {
        if self.0.is_empty() {
            return Some(id);
        }
        self.0
            .iter()
            .find(|r| id >= r.shown && id - r.shown < r.len)
            .map(|r| r.stored + (id - r.shown))
    }
}

/// An upper entry's metadata as the merged tree shows it (ids as stored).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Meta {
    /// Type and permission bits.
    pub(crate) mode: u32,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) size: u64,
    pub(crate) blocks: u64,
    pub(crate) nlink: u32,
    pub(crate) rdev: u64,
    pub(crate) atime: (i64, u32),
    pub(crate) mtime: (i64, u32),
    pub(crate) ctime: (i64, u32),
    /// On disk: the upper entry's own identity and type.
    pub(crate) dev: u64,
    pub(crate) ino: u64,
    pub(crate) disk_mode: u32,
}

impl Meta {
    pub(crate) fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }

    pub(crate) fn is_whiteout(&self) -> bool {
        self.disk_mode & S_IFMT == libc::S_IFCHR && self.rdev == 0
    }

    pub(crate) fn from_stat(st: &rustix::fs::Stat) -> Meta {
        Meta {
            mode: st.st_mode,
            uid: st.st_uid,
            gid: st.st_gid,
            size: st.st_size as u64,
            blocks: st.st_blocks as u64,
            nlink: st.st_nlink as u32,
            rdev: st.st_rdev,
            atime: (st.st_atime, st.st_atime_nsec as u32),
            mtime: (st.st_mtime, st.st_mtime_nsec as u32),
            ctime: (st.st_ctime, st.st_ctime_nsec as u32),
            dev: st.st_dev,
            ino: st.st_ino,
            disk_mode: st.st_mode,
        }
    }

    /// Applies an override: the recorded owner and mode, and the type a
    /// stand-in regular file stands for.
    pub(crate) fn with(mut self, o: &Override) -> Meta {
        self.uid = o.uid;
        self.gid = o.gid;
        let typ = match o.typ {
            Some((t, rdev)) if self.disk_mode & S_IFMT == S_IFREG => {
                self.rdev = rdev;
                if t != S_IFLNK {
                    self.size = 0;
                }
                t
            }
            _ => self.disk_mode & S_IFMT,
        };
        self.mode = typ | o.perm;
        self
    }
}

/// Who the server is, and what it may do in the upper directory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Powers {
    /// Root with CAP_CHOWN and CAP_FOWNER (in the namespace owning the
    /// upper directory's filesystem): owners, modes and every xattr are
    /// applied as they are.
    pub(crate) privileged: bool,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

impl Powers {
    pub(crate) fn of_this_process() -> Powers {
        use rustix::thread::CapabilitySet as C;
        let caps = rustix::thread::capabilities(None).map_or(C::empty(), |c| c.effective);
        let privileged = rustix::process::geteuid().is_root()
            && caps.contains(C::CHOWN | C::FOWNER | C::DAC_OVERRIDE | C::SYS_ADMIN | C::MKNOD);
        Powers {
            privileged,
            uid: rustix::process::geteuid().as_raw(),
            gid: rustix::process::getegid().as_raw(),
        }
    }
}

/// The upper and work directories of a writable mount.
pub(crate) struct Upper {
    /// The upper directory (O_PATH).
    pub(crate) root: OwnedFd,
    /// Our private directory in the work directory (O_PATH): temporary
    /// files of copy-ups and creations, and whiteouts in the making.
    pub(crate) work: OwnedFd,
    /// Held (flock) while mounted: one server per upper directory.
    _lock: OwnedFd,
    pub(crate) dev: u64,
    pub(crate) ns: Ns,
    pub(crate) powers: Powers,
    pub(crate) uids: IdMap,
    pub(crate) gids: IdMap,
    next_tmp: AtomicU64,
}

/// "/proc/self/fd/N" or "/proc/self/fd/N/NAME": a path to an entry that
/// xattr calls can take without our following any link in the upper
/// directory (the descriptor's magic link is the kernel's, and NAME is
/// used with the `l` calls, which do not follow it).
pub(crate) fn proc_path(fd: BorrowedFd<'_>, name: Option<&[u8]>) -> CString {
    let mut p = format!("/proc/self/fd/{}", fd.as_raw_fd()).into_bytes();
    if let Some(n) = name {
        p.push(b'/');
        p.extend_from_slice(n);
    }
    CString::new(p).expect("names hold no NUL")
}

/// An upper entry to change: a name in a directory, or a file we hold
/// open (one with no name, or just made).
#[derive(Clone, Copy)]
pub(crate) enum Target<'a> {
    At(BorrowedFd<'a>, &'a [u8]),
    Fd(BorrowedFd<'a>),
}

impl Target<'_> {
    pub(crate) fn xpath(&self) -> XPath {
        match *self {
            Target::At(d, n) => XPath::at(d, n),
            Target::Fd(f) => XPath::of(f),
        }
    }

    pub(crate) fn stat(&self) -> Result<rustix::fs::Stat, Errno> {
        match *self {
            Target::At(d, n) => rustix::fs::statat(d, n, AtFlags::SYMLINK_NOFOLLOW),
            Target::Fd(f) => rustix::fs::fstat(f),
        }
    }

    pub(crate) fn chown(&self, uid: u32, gid: u32) -> Result<(), Errno> {
        let (u, g) = (
            Some(rustix::process::Uid::from_raw(uid)),
            Some(rustix::process::Gid::from_raw(gid)),
        );
        match *self {
            Target::At(d, n) => rustix::fs::chownat(d, n, u, g, AtFlags::SYMLINK_NOFOLLOW),
            // Also for O_PATH descriptors, which fchown does not take.
            Target::Fd(f) => rustix::fs::chownat(f, "", u, g, AtFlags::EMPTY_PATH),
        }
    }

    /// chmod, never following a symlink (a symlink is left as it is).
    pub(crate) fn chmod(&self, perm: u32) -> Result<(), Errno> {
        match *self {
            Target::At(d, n) => chmod_nofollow(d, n, perm),
            // O_PATH descriptors take no fchmod: through their magic link,
            // which is the file itself.
            Target::Fd(f) => match rustix::fs::fchmod(f, Mode::from_raw_mode(perm)) {
                Err(Errno::BADF) => rustix::fs::chmod(proc_path(f, None).as_c_str(), Mode::from_raw_mode(perm)),
                r => r,
            },
        }
    }

    pub(crate) fn set_times(&self, atime: rustix::fs::Timespec, mtime: rustix::fs::Timespec) -> Result<(), Errno> {
        let ts = rustix::fs::Timestamps {
            last_access: atime,
            last_modification: mtime,
        };
        match *self {
            Target::At(d, n) => rustix::fs::utimensat(d, n, &ts, AtFlags::SYMLINK_NOFOLLOW),
            Target::Fd(f) => rustix::fs::utimensat(f, "", &ts, AtFlags::EMPTY_PATH),
        }
    }
}

/// A chmod that never follows a symlink planted in the upper directory (a
/// symlink itself is left as it is, having no mode of its own).
pub(crate) fn chmod_nofollow(dir: BorrowedFd<'_>, name: &[u8], mode: u32) -> Result<(), Errno> {
    match tilefs_sys::fs::chmod_nofollow(dir, name, mode) {
        Ok(()) | Err(Errno::OPNOTSUPP) => Ok(()),
        Err(Errno::NOSYS) => {
            // Before Linux 6.6: through a descriptor of the entry itself.
            let fd = rustix::fs::openat(
                dir,
                name,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            if rustix::fs::fstat(&fd)?.st_mode & S_IFMT == S_IFLNK {
                return Ok(());
            }
            rustix::fs::chmod(proc_path(fd.as_fd(), None).as_c_str(), Mode::from_raw_mode(mode))
        }
        Err(e) => Err(e),
    }
}

/// An error as an errno for the kernel.
pub(crate) fn errno(e: Errno) -> i32 {
    e.raw_os_error()
}

/// Where xattr calls go: an entry of a directory (a symlink there is
/// never followed), or the file a descriptor of ours holds (through its
/// magic link, which leads to that very file).
pub(crate) struct XPath {
    c: CString,
    follow: bool,
}

impl XPath {
    pub(crate) fn at(dir: BorrowedFd<'_>, name: &[u8]) -> XPath {
        XPath {
            c: proc_path(dir, Some(name)),
            follow: false,
        }
    }

    pub(crate) fn of(fd: BorrowedFd<'_>) -> XPath {
        XPath {
            c: proc_path(fd, None),
            follow: true,
        }
    }

    fn get_into(&self, key: &[u8], buf: &mut [u8]) -> Result<usize, Errno> {
        if self.follow {
            rustix::fs::getxattr(self.c.as_c_str(), key, buf)
        } else {
            rustix::fs::lgetxattr(self.c.as_c_str(), key, buf)
        }
    }

    /// An xattr's value; None if there is none.
    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Errno> {
        let mut buf = vec![0u8; 256];
        loop {
            match self.get_into(key, &mut buf) {
                Ok(n) => {
                    buf.truncate(n);
                    return Ok(Some(buf));
                }
                Err(Errno::NODATA) | Err(Errno::NOTSUP) => return Ok(None),
                Err(Errno::RANGE) => {
                    let n = self.get_into(key, &mut [0u8; 0][..])?;
                    buf.resize(n.max(buf.len() * 2), 0);
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn list_into(&self, buf: &mut [u8]) -> Result<usize, Errno> {
        if self.follow {
            rustix::fs::listxattr(self.c.as_c_str(), buf)
        } else {
            rustix::fs::llistxattr(self.c.as_c_str(), buf)
        }
    }

    /// The names of its xattrs.
    pub(crate) fn list(&self) -> Result<Vec<Vec<u8>>, Errno> {
        let mut buf = vec![0u8; 1024];
        let n = loop {
            match self.list_into(&mut buf) {
                Ok(n) => break n,
                Err(Errno::RANGE) => {
                    let n = self.list_into(&mut [0u8; 0][..])?;
                    buf.resize(n.max(buf.len() * 2), 0);
                }
                Err(Errno::NOTSUP) => return Ok(Vec::new()),
                Err(e) => return Err(e),
            }
        };
        Ok(buf[..n]
            .split(|&c| c == 0)
            .filter(|k| !k.is_empty())
            .map(<[u8]>::to_vec)
            .collect())
    }

    pub(crate) fn set(&self, key: &[u8], value: &[u8], flags: rustix::fs::XattrFlags) -> Result<(), Errno> {
        if self.follow {
            rustix::fs::setxattr(self.c.as_c_str(), key, value, flags)
        } else {
            rustix::fs::lsetxattr(self.c.as_c_str(), key, value, flags)
        }
    }

    pub(crate) fn remove(&self, key: &[u8]) -> Result<(), Errno> {
        if self.follow {
            rustix::fs::removexattr(self.c.as_c_str(), key)
        } else {
            rustix::fs::lremovexattr(self.c.as_c_str(), key)
        }
    }
}

impl Upper {
    /// Opens the upper and work directories, checks they can serve, and
    /// takes the work directory for this server (clearing what a server
    /// that died left in it).
    pub(crate) fn open(upper: &Path, work: &Path, uids: IdMap, gids: IdMap) -> Result<Upper, String> {
        let open_dir = |p: &Path, what: &str| {
            rustix::fs::open(p, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| format!("{what} directory {}: {e}", p.display()))
        };
        let root = open_dir(upper, "upper")?;
        let workdir = open_dir(work, "work")?;
        let ust = rustix::fs::fstat(&root).map_err(|e| format!("{}: {e}", upper.display()))?;
        let wst = rustix::fs::fstat(&workdir).map_err(|e| format!("{}: {e}", work.display()))?;
        if ust.st_dev != wst.st_dev {
            return Err(format!(
                "the upper directory {} and the work directory {} are on different filesystems: they must be on the same one",
                upper.display(),
                work.display()
            ));
        }
        if ust.st_ino == wst.st_ino {
            return Err(format!(
                "{}: the upper and work directories must differ",
                upper.display()
            ));
        }
        // Neither may be inside the other: a rename between them would
        // move our own files into the tree, or the tree into our files.
        let (ucanon, wcanon) = (
            std::fs::canonicalize(upper).map_err(|e| format!("{}: {e}", upper.display()))?,
            std::fs::canonicalize(work).map_err(|e| format!("{}: {e}", work.display()))?,
        );
        if ucanon.starts_with(&wcanon) || wcanon.starts_with(&ucanon) {
            return Err(format!(
                "the upper directory {} and the work directory {} must not be inside one another",
                upper.display(),
                work.display()
            ));
        }
        for (fd, p, what) in [(&root, upper, "upper"), (&workdir, work, "work")] {
            rustix::fs::accessat(
                fd,
                ".",
                rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
                AtFlags::EACCESS,
            )
            .map_err(|e| format!("the {what} directory {} is not writable: {e}", p.display()))?;
        }
        let powers = Powers::of_this_process();
        // Our own subdirectory of the work directory, as overlayfs keeps
        // work/work: whatever a dead server left there is removed.
        let name = "tilefs";
        match rustix::fs::mkdirat(&workdir, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(format!("{}: cannot make {name}: {e}", work.display())),
        }
        let ours = rustix::fs::openat2(
            &workdir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| format!("{}/{name}: {e}", work.display()))?;
        let lock = rustix::fs::openat(
            &ours,
            "lock",
            OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| format!("{}/{name}/lock: {e}", work.display()))?;
        // The server of the previous mount of these directories may still
        // be on its way out: `tilefs umount` cannot wait for a server
        // without a runtime directory (see server_lock).
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
            if std::time::Instant::now() >= end {
                return Err(format!(
                    "the work directory {} is in use by another writable mount: an upper directory serves one mount at a time",
                    work.display()
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        clear_dir(ours.as_fd(), &[b"lock"]).map_err(|e| format!("{}/{name}: cannot clear it: {e}", work.display()))?;
        let work = rustix::fs::openat(
            &ours,
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| format!("{}/{name}: {e}", work.display()))?;
        Ok(Upper {
            root,
            work,
            _lock: lock,
            dev: ust.st_dev,
            ns: if powers.privileged { Ns::Trusted } else { Ns::User },
            powers,
            uids,
            gids,
            next_tmp: AtomicU64::new(0),
        })
    }

    /// A fresh name for a temporary entry in the work directory.
    pub(crate) fn tmp_name(&self) -> CString {
        let n = self.next_tmp.fetch_add(1, Ordering::Relaxed);
        CString::new(format!("#{}.{n}", std::process::id())).expect("no NUL")
    }

    /// Stats `name` in directory `dir`, not following a symlink, and
    /// applies what the override xattr records.
    pub(crate) fn meta_at(&self, dir: BorrowedFd<'_>, name: &[u8]) -> Result<Meta, Errno> {
        let st = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)?;
        let m = Meta::from_stat(&st);
        self.with_override(m, || XPath::at(dir, name))
    }

    /// Stats the directory `fd` itself.
    pub(crate) fn meta_of_dir(&self, fd: BorrowedFd<'_>) -> Result<Meta, Errno> {
        let st = rustix::fs::fstat(fd)?;
        self.with_override(Meta::from_stat(&st), || XPath::of(fd))
    }

    fn with_override(&self, m: Meta, path: impl FnOnce() -> XPath) -> Result<Meta, Errno> {
        let t = m.disk_mode & S_IFMT;
        if self.powers.privileged || (t != S_IFREG && t != S_IFDIR) {
            return Ok(m);
        }
        match path().get(OVERRIDE)? {
            Some(v) => Ok(Override::parse(&v).map_or(m, |o| m.with(&o))),
            None => Ok(m),
        }
    }

    /// Whether the directory at `path` (a proc path) is opaque.
    pub(crate) fn is_opaque(&self, path: &XPath) -> bool {
        matches!(path.get(self.ns.key("opaque").as_bytes()), Ok(Some(v)) if v == b"y")
    }

    /// Where the directory at `path` was moved from, if it was.
    pub(crate) fn redirect(&self, path: &XPath) -> Option<Vec<u8>> {
        path.get(self.ns.key("redirect").as_bytes()).ok().flatten()
    }

    pub(crate) fn set_marker(&self, path: &XPath, what: &str, value: &[u8]) -> Result<(), Errno> {
        path.set(self.ns.key(what).as_bytes(), value, rustix::fs::XattrFlags::empty())
    }

    pub(crate) fn remove_marker(&self, path: &XPath, what: &str) -> Result<(), Errno> {
        match path.remove(self.ns.key(what).as_bytes()) {
            Ok(()) | Err(Errno::NODATA) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Makes a whiteout named `name` in `dir`.
    pub(crate) fn mknod_whiteout(&self, dir: BorrowedFd<'_>, name: &[u8]) -> Result<(), Errno> {
        rustix::fs::mknodat(dir, name, rustix::fs::FileType::CharacterDevice, Mode::empty(), 0)
    }

    /// Records `o` for the entry at `path`, or removes the record when
    /// the entry on disk already says it all.
    pub(crate) fn set_override(&self, path: &XPath, o: Option<&Override>) -> Result<(), Errno> {
        match o {
            Some(o) => path.set(OVERRIDE, o.format().as_bytes(), rustix::fs::XattrFlags::empty()),
            None => match path.remove(OVERRIDE) {
                Ok(()) | Err(Errno::NODATA) => Ok(()),
                Err(e) => Err(e),
            },
        }
    }

    /// The mode kept on disk for a logical mode, without privilege: the
    /// server keeps read and write (and search, for directories) access.
    pub(crate) fn disk_perm(&self, mode: u32) -> u32 {
        let perm = mode & 0o7777;
        if self.powers.privileged {
            perm
        } else if mode & S_IFMT == S_IFDIR {
            perm | 0o700
        } else {
            perm | 0o600
        }
    }

    /// Gives the upper entry `t` the logical owner and mode `(uid, gid,
    /// mode)`: applied where the server may, recorded in the override
    /// xattr where it may not. `stand_in`: the entry on disk is a regular
    /// file standing for type `mode` (with this device number). `fresh`:
    /// just made by us with the disk mode, owned by the server, no xattr.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn set_owner_mode(
        &self,
        t: Target<'_>,
        uid: u32,
        gid: u32,
        mode: u32,
        stand_in: Option<u64>,
        fresh: bool,
    ) -> Result<(), Errno> {
        let typ = mode & S_IFMT;
        let perm = mode & 0o7777;
        if self.powers.privileged {
            let chown = !fresh || (uid, gid) != (self.powers.uid, self.powers.gid);
            if chown {
                t.chown(uid, gid)?;
            }
            // chown clears setuid and setgid; mkdir and open may not set
            // them: set the mode last.
            if typ != S_IFLNK && (!fresh || perm & 0o7000 != 0) {
                t.chmod(perm)?;
            }
            return Ok(());
        }
        let own = (uid, gid) == (self.powers.uid, self.powers.gid);
        let disk = self.disk_perm(mode);
        if fresh && own && stand_in.is_none() && disk == perm {
            return Ok(());
        }
        // Others' ids may work in a user namespace that maps them.
        let owned = own || t.chown(uid, gid).is_ok();
        let special = !matches!(typ, S_IFREG | S_IFDIR);
        if special && stand_in.is_none() {
            // Symlinks and special files hold no user xattrs: they are
            // real only when their owner is, and have their exact mode
            // (the server never opens them).
            if !owned {
                return Err(Errno::PERM);
            }
            return if typ == S_IFLNK { Ok(()) } else { t.chmod(perm) };
        }
        // chmod may drop setgid for a group we are not in: the override
        // keeps the logical bits either way.
        let _ = t.chmod(disk);
        let on_disk = t.stat()?.st_mode & 0o7777;
        let needed = stand_in.is_some() || !owned || on_disk != perm;
        if fresh && !needed {
            return Ok(());
        }
        let o = Override {
            uid,
            gid,
            perm,
            typ: stand_in.map(|rdev| (typ, rdev)),
        };
        self.set_override(&t.xpath(), needed.then_some(&o))
    }

    /// Whether an entry of type `mode` owned by `uid:gid` must be stored
    /// as a stand-in regular file (without privilege: devices always;
    /// symlinks and special files owned by another).
    pub(crate) fn needs_stand_in(&self, mode: u32, uid: u32, gid: u32) -> bool {
        if self.powers.privileged {
            return false;
        }
        match mode & S_IFMT {
            S_IFREG | S_IFDIR => false,
            libc::S_IFCHR | libc::S_IFBLK => true,
            _ => (uid, gid) != (self.powers.uid, self.powers.gid),
        }
    }

    /// Opens the directory `name` of `dir` (O_PATH), never through a
    /// symlink.
    pub(crate) fn open_dir_at(&self, dir: BorrowedFd<'_>, name: &[u8]) -> Result<OwnedFd, Errno> {
        rustix::fs::openat2(
            dir,
            name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
        )
    }

    /// Opens the file `name` of `dir` for I/O, never through a symlink
    /// and never blocking (a FIFO planted in the upper directory).
    pub(crate) fn open_file_at(&self, dir: BorrowedFd<'_>, name: &[u8], flags: OFlags) -> Result<OwnedFd, Errno> {
        let fd = rustix::fs::openat2(
            dir,
            name,
            flags | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NOCTTY | OFlags::NONBLOCK,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if st.st_mode & S_IFMT != S_IFREG {
            return Err(Errno::INVAL);
        }
        // Back to blocking I/O for the file itself.
        let fl = rustix::fs::fcntl_getfl(&fd)?;
        rustix::fs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK)?;
        Ok(fd)
    }

    /// Reads the target a stand-in file of a symlink holds.
    pub(crate) fn stand_in_target(&self, dir: BorrowedFd<'_>, name: &[u8]) -> Result<Vec<u8>, Errno> {
        let fd = self.open_file_at(dir, name, OFlags::RDONLY)?;
        let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
        let n = rustix::io::read(&fd, &mut buf)?;
        buf.truncate(n.min(libc::PATH_MAX as usize));
        Ok(buf)
    }
}

/// Removes everything in `dir` but the names in `keep` (recursively, never
/// following symlinks).
pub(crate) fn clear_dir(dir: BorrowedFd<'_>, keep: &[&[u8]]) -> Result<(), Errno> {
    let fd = rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    let mut d = rustix::fs::Dir::read_from(&fd)?;
    while let Some(e) = d.read() {
        let e = e?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." && !keep.contains(&n) {
            names.push((n.to_vec(), e.file_type()));
        }
    }
    for (n, t) in names {
        match rustix::fs::unlinkat(&fd, n.as_slice(), AtFlags::empty()) {
            Ok(()) => {}
            Err(Errno::ISDIR) | Err(Errno::PERM)
                if t == rustix::fs::FileType::Directory || t == rustix::fs::FileType::Unknown =>
            {
                let sub = rustix::fs::openat2(
                    &fd,
                    n.as_slice(),
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
                )?;
                // A directory we cannot enter is made ours first.
                let _ = chmod_nofollow(fd.as_fd(), n.as_slice(), 0o700);
                clear_dir(sub.as_fd(), &[])?;
                rustix::fs::unlinkat(&fd, n.as_slice(), AtFlags::REMOVEDIR)?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// An entry name as it may appear on the command line or in a log.
pub(crate) fn shown(name: &[u8]) -> String {
    std::ffi::OsStr::from_bytes(name).to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_maps() {
        let m = IdMap::parse("0:1000:1:1:100000:65536").unwrap();
        assert_eq!(
            (m.show(0), m.show(1), m.show(65536), m.show(70000)),
            (1000, 100000, 165535, 65534)
        );
        assert_eq!((m.store(1000), m.store(100005), m.store(5)), (Some(0), Some(6), None));
        assert!(IdMap::parse("0:1000").is_err());
        assert!(IdMap::parse("0:1000:0").is_err());
        assert!(IdMap::parse("4294967295:0:2").is_err());
        assert_eq!(IdMap::default().show(7), 7);
    }
}
