//! Placeholders: objects not fetched yet, present at their object path
//! with their size, so that a kernel (composefs) mount of a lazily pulled
//! image resolves every redirect; a filler holding a fanotify group fills
//! each on its first open or read (tilefs-present's `kernel_lazy`).
//!
//! A placeholder is a sparse regular file of mode 01000: no permission
//! bits (only root, whose tools check the mode, can open it at all) and
//! the sticky bit, which no object ever has (ingest makes objects 0644).
//! The mode is the marker because every object lookup stats the file
//! anyway (so checking costs nothing), because it is metadata the
//! filesystem keeps across a crash, and because a fill changes it in one
//! call after the bytes are durable: a fill cut short leaves a
//! placeholder, never an object with holes. Listings that look at names
//! only (`presence`) learn the placeholders from an index,
//! `STORE/.placeholders/<digest>`, written before the placeholder appears
//! and swept once it is filled or gone; the mode decides where the two
//! disagree (a crash between them).

use crate::{Store, StoreError};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use std::collections::HashSet;
use std::io;

/// The index of placeholders, under the store.
pub use crate::layout::PLACEHOLDER_DIR;
/// A placeholder's mode (and no object's).
pub const MODE: u32 = 0o1000;

/// Whether a stat is a placeholder's.
pub fn is_placeholder(st: &rfs::Stat) -> bool {
    rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile && st.st_mode & 0o7777 == MODE
}

/// Makes a placeholder of `size` bytes for the object `digest`, unless
/// the store has it (or a placeholder of it) already. Returns whether one
/// was made. Its index entry is a second link to it, so that once filled
/// it can be renamed back over its object path (see [`settle`]). (Many at
/// once: [`Maker`].)
pub fn create(store: &Store, digest: &[u8; 32], size: u64) -> Result<bool, StoreError> {
    Maker::new(store)?.create(digest, size)
}

/// Makes many placeholders of one store, its directories opened once (an
/// image of 50k files makes 50k placeholders before its mount).
pub struct Maker<'a> {
    store: &'a Store,
    index: OwnedFd,
    fanouts: Vec<std::sync::OnceLock<OwnedFd>>,
}

impl<'a> Maker<'a> {
    /// Opens the store's directories a placeholder is made in.
    pub fn new(store: &'a Store) -> Result<Maker<'a>, StoreError> {
        Ok(Maker {
            store,
            index: store.open_subdir(PLACEHOLDER_DIR)?,
            fanouts: (0..256).map(|_| std::sync::OnceLock::new()).collect(),
        })
    }

    /// The fan-out directory of `digest`, opened once.
    fn fanout(&self, digest: &[u8; 32]) -> Result<&OwnedFd, StoreError> {
        let slot = &self.fanouts[digest[0] as usize];
        if let Some(fd) = slot.get() {
            return Ok(fd);
        }
        let fd = self.store.open_fanout(digest)?;
        Ok(slot.get_or_init(|| fd))
    }

    /// [`create`].
    pub fn create(&self, digest: &[u8; 32], size: u64) -> Result<bool, StoreError> {
        self.create_armed(digest, size, |_| Ok(()))
    }

    /// [`create`], with `arm` called on the new placeholder before it gets
    /// its object name (a fanotify group marks it then: no mount reaches
    /// it unmarked, and the mark costs no path walk). The placeholder is
    /// not made if `arm` fails.
    pub fn create_armed(
        &self,
        digest: &[u8; 32],
        size: u64,
        arm: impl FnOnce(BorrowedFd<'_>) -> io::Result<()>,
    ) -> Result<bool, StoreError> {
        let rel = Store::object_rel(digest);
        let fan = self.fanout(digest)?;
        if rfs::statat(fan, &rel[3..], AtFlags::SYMLINK_NOFOLLOW).is_ok() {
            return Ok(false);
        }
        let path = self.store.join(&rel);
        let failed = |e: rustix::io::Errno| StoreError::io(&path, "cannot create a placeholder", e.into());
        let (index, name) = (&self.index, hex::encode(digest));
        // Made as its index entry (listed first: a placeholder is never
        // at its object path unlisted), then given its object name: two
        // changes of directories, not a temporary name's five.
        let create = || {
            rfs::openat(
                index,
                name.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::empty(),
            )
        };
        let fd = match create() {
            Err(rustix::io::Errno::EXIST) if is_at(self.store, digest) => return Ok(false),
            // A stale entry (its placeholder filled or gone): replaced.
            Err(rustix::io::Errno::EXIST) => {
                let _ = rfs::unlinkat(index, name.as_str(), AtFlags::empty());
                create()
            }
            fd => fd,
        }
        .map_err(failed)?;
        let made = rfs::ftruncate(&fd, size)
            .and_then(|()| rfs::fchmod(&fd, Mode::from_raw_mode(MODE)))
            .and_then(|()| {
                arm(fd.as_fd()).map_err(|e| rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::IO))
            })
            .and_then(|()| rfs::linkat(index, name.as_str(), fan, &rel[3..], AtFlags::empty()));
        match made {
            Ok(()) => Ok(true),
            // Stored meanwhile (an object, or another's placeholder).
            Err(rustix::io::Errno::EXIST) => {
                sweep_one(self.store, index, digest);
                Ok(false)
            }
            Err(e) => {
                sweep_one(self.store, index, digest);
                Err(failed(e))
            }
        }
    }
}

/// The placeholders of the store: those its index lists whose object path
/// holds a placeholder still (usually none; one directory listing then).
pub fn list(store: &Store) -> HashSet<[u8; 32]> {
    listed(store).into_iter().filter(|d| is_at(store, d)).collect()
}

/// What the index lists, whatever the object paths hold now.
fn listed(store: &Store) -> Vec<[u8; 32]> {
    let Ok(dir) = store.open_existing_subdir(PLACEHOLDER_DIR) else {
        return Vec::new();
    };
    let Ok(mut entries) = rfs::Dir::read_from(&dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    while let Some(Ok(e)) = entries.next() {
        let mut d = [0u8; 32];
        if hex::decode_to_slice(e.file_name().to_bytes(), &mut d).is_ok() {
            out.push(d);
        }
    }
    out
}

/// Whether the object path of `digest` holds a placeholder.
pub fn is_at(store: &Store, digest: &[u8; 32]) -> bool {
    rfs::statat(store.dir_fd(), Store::object_rel(digest), AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|st| is_placeholder(&st))
}

/// Drops the index entries whose object path holds no placeholder now
/// (filled, fetched by other means, or removed by gc). Returns how many.
pub fn sweep(store: &Store, dry_run: bool) -> usize {
    let Ok(dir) = store.open_existing_subdir(PLACEHOLDER_DIR) else {
        return 0;
    };
    let stale: Vec<_> = listed(store).into_iter().filter(|d| !is_at(store, d)).collect();
    if !dry_run {
        for d in &stale {
            sweep_one(store, &dir, d);
        }
    }
    stale.len()
}

fn sweep_one(store: &Store, index: &OwnedFd, digest: &[u8; 32]) {
    if !is_at(store, digest) {
        let _ = rfs::unlinkat(index, hex::encode(digest), AtFlags::empty());
    }
}

/// After a fill of `filled` (the placeholder's inode, no longer one):
/// gives it back its object name, replacing the copy a fetch stored
/// there meanwhile (so the object is on disk once, in the inode mounts
/// already hold), and drops its index entry.
pub fn settle(store: &Store, digest: &[u8; 32], filled: &OwnedFd) -> Result<(), StoreError> {
    let index = store.open_subdir(PLACEHOLDER_DIR)?;
    let name = hex::encode(digest);
    let (st, entry) = (
        rfs::fstat(filled).map_err(|e| StoreError::io(&store.object_path(digest), "cannot stat", e.into()))?,
        rfs::statat(&index, name.as_str(), AtFlags::SYMLINK_NOFOLLOW),
    );
    let ours = entry.is_ok_and(|e| (e.st_dev, e.st_ino) == (st.st_dev, st.st_ino));
    if ours && !is_placeholder(&st) {
        let rel = Store::object_rel(digest);
        let fan = store.open_fanout(digest)?;
        rfs::renameat(&index, name.as_str(), &fan, &rel[3..])
            .map_err(|e| StoreError::io(&store.join(&rel), "cannot rename into place", e.into()))?;
    }
    // (Renamed onto another link of itself, the entry stays: dropped.)
    sweep_one(store, &index, digest);
    Ok(())
}

/// Opens the placeholder of `digest` to fill in place, if the store has
/// one of `size` bytes and no other fill holds it, or with `wait`, once
/// that other fill is done (None: no placeholder, or filled meanwhile, or
/// held by another fill, or served by a kernel lazy mount: store the
/// object the ordinary way; a filler finds it there and copies it in).
/// Outside a filler, a placeholder a lazy mount serves is left to its
/// filler: an open of it would wait for that filler, which may wait for
/// this very fetch (its lock on the object). In a filler
/// ([`fill_only_through_offers`]), only the one it holds the lock of.
pub fn fill_in_place(store: &Store, digest: &[u8; 32], size: u64, wait: bool) -> Option<InPlace> {
    // In a filler, the lock is held already through the offered
    // descriptor (an event's: on a read-only mount, so not the one to
    // seal it through).
    let held = match OFFERS.get() {
        Some(offers) => Some(rfs::fstat(offers.lock().unwrap().get(digest)?).ok()?),
        None if served(store) => return None,
        None => None,
    };
    let index = store.open_existing_subdir(PLACEHOLDER_DIR).ok()?;
    let name = hex::encode(digest);
    let open = |flags| {
        rfs::openat(
            &index,
            name.as_str(),
            flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()
    };
    // Read-only, so that fs-verity can be enabled through it once the
    // writer is closed; the writer is opened once the lock is held.
    let lock = open(OFlags::RDONLY)?;
    if let Some(held) = held {
        let st = rfs::fstat(&lock).ok()?;
        if (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino) {
            return None;
        }
    }
    through(store, lock, held.is_none(), || open(OFlags::RDWR), digest, size, wait)
}

/// [`fill_in_place`] of the placeholder `lock` is open on (locked through
/// it if `take_lock`), written through what `writer` opens on it.
fn through(
    store: &Store,
    lock: OwnedFd,
    take_lock: bool,
    writer: impl FnOnce() -> Option<OwnedFd>,
    digest: &[u8; 32],
    size: u64,
    wait: bool,
) -> Option<InPlace> {
    let how = match wait {
        true => rfs::FlockOperation::LockExclusive,
        false => rfs::FlockOperation::NonBlockingLockExclusive,
    };
    if take_lock {
        rfs::flock(&lock, how).ok()?;
    }
    let st = rfs::fstat(&lock).ok()?;
    if !is_placeholder(&st) || st.st_size as u64 != size {
        return None;
    }
    // Filled, made fs-verity and cut short before its marker went: its
    // bytes are the object's (verity is enabled only on durable, checked
    // bytes), and it can no longer be written.
    if tilefs_sys::verity::measure(lock.as_fd()) == Ok(Some(*digest)) {
        let _ = seal(&lock).and_then(|()| settle(store, digest, &lock).map_err(io::Error::other));
        return None;
    }
    let file = writer()?;
    let again = rfs::fstat(&file).ok()?;
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) {
        return None;
    }
    rfs::ftruncate(&file, 0)
        .and_then(|()| rfs::ftruncate(&file, size))
        .ok()?;
    Some(InPlace {
        lock,
        file: std::fs::File::from(file),
        size,
    })
}

/// The lock every kernel lazy mount of the store holds (shared) while it
/// serves it, under [`PLACEHOLDER_DIR`].
const SERVING: &str = ".filling";

/// Says that a kernel lazy mount serves placeholders of `store` until the
/// result is closed (by every process holding a copy).
pub fn hold_serving(store: &Store) -> io::Result<OwnedFd> {
    let index = store.open_subdir(PLACEHOLDER_DIR).map_err(io::Error::other)?;
    let fd = rfs::openat(
        &index,
        SERVING,
        OFlags::RDONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    rfs::flock(&fd, rfs::FlockOperation::LockShared)?;
    Ok(fd)
}

/// Whether a kernel lazy mount serves placeholders of `store` now.
fn served(store: &Store) -> bool {
    let Ok(index) = store.open_existing_subdir(PLACEHOLDER_DIR) else {
        return false;
    };
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    rfs::openat(&index, SERVING, flags, Mode::empty()).is_ok_and(|fd| {
        rfs::flock(&fd, rfs::FlockOperation::NonBlockingLockExclusive) == Err(rustix::io::Errno::WOULDBLOCK)
    })
}

/// The descriptors a filler offers its fills, by object: set in a filler
/// only (see [`fill_only_through_offers`]).
static OFFERS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<[u8; 32], OwnedFd>>> =
    std::sync::OnceLock::new();

/// Makes this process a filler's: from now on a placeholder is filled in
/// place only once its lock is held through a descriptor offered for it
/// ([`offer`]: a fanotify event's, whose open asked no group). Lazy
/// mounts' groups let the accesses of a process holding a placeholder's
/// lock through, and make every other wait for a fill: a filler's open
/// of a placeholder it has not locked would wait for itself.
pub fn fill_only_through_offers() {
    OFFERS.get_or_init(Default::default);
}

/// Offers `fd` (on the placeholder of `digest`, holding its lock) to the
/// fills of this process until the result is dropped.
pub fn offer(digest: &[u8; 32], fd: rustix::fd::BorrowedFd<'_>) -> io::Result<Offered> {
    let offers = OFFERS
        .get()
        .ok_or_else(|| io::Error::other("not a filler (fill_only_through_offers)"))?;
    offers.lock().unwrap().insert(*digest, fd.try_clone_to_owned()?);
    Ok(Offered(*digest))
}

/// An offer of [`offer`], withdrawn when dropped.
pub struct Offered([u8; 32]);

impl Drop for Offered {
    fn drop(&mut self) {
        if let Some(offers) = OFFERS.get() {
            offers.lock().unwrap().remove(&self.0);
        }
    }
}

/// A placeholder this process fills in place (a fetch writes straight
/// into it, so the object is written once): its inode, locked so one fill
/// of any process writes it at a time, emptied to holes of its size
/// (bytes an earlier fill cut short are gone; a hole is a zero the fill's
/// hash counted).
pub struct InPlace {
    /// Read-only (and holding the lock, but in a filler, which holds it
    /// through its offer): fs-verity is enabled through it once the
    /// writer is closed.
    lock: OwnedFd,
    /// Where the bytes go.
    pub file: std::fs::File,
    size: u64,
}

impl InPlace {
    /// The placeholder's stat.
    pub fn stat(&self) -> io::Result<rfs::Stat> {
        Ok(rfs::fstat(&self.lock)?)
    }

    /// Makes the checked bytes written the object `digest`: durable first,
    /// then fs-verity enabled where `verity` can (given the read-only
    /// descriptor, after the writer is closed), then no longer a
    /// placeholder ([`seal`]), then named as the object ([`settle`]).
    pub fn finish(
        self,
        store: &Store,
        digest: &[u8; 32],
        verity: impl FnOnce(rustix::fd::BorrowedFd<'_>),
    ) -> io::Result<()> {
        rfs::fsync(&self.file)?;
        drop(self.file);
        verity(self.lock.as_fd());
        seal(&self.lock)?;
        settle(store, digest, &self.lock).map_err(io::Error::other)
    }

    /// Leaves it a placeholder, emptied again.
    pub fn abandon(self) {
        let _ = rfs::ftruncate(&self.file, 0).and_then(|()| rfs::ftruncate(&self.file, self.size));
    }
}

/// Copies `object` into the placeholder `target` (a descriptor of its
/// inode open for writing); it stays a placeholder until [`seal`]. The
/// caller has made sure no reader gets a byte before then (it holds their
/// events).
pub fn copy_into(target: impl AsFd, object: &std::fs::File) -> io::Result<u64> {
    let target = target.as_fd();
    let size = object.metadata()?.len();
    let (mut src_off, mut dst_off) = (0u64, 0u64);
    while dst_off < size {
        let want = (size - dst_off).min(1 << 30) as usize;
        let n = rfs::copy_file_range(object.as_fd(), Some(&mut src_off), target, Some(&mut dst_off), want)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the object ended after {dst_off} of {size} bytes"),
            ));
        }
    }
    rfs::ftruncate(target, size)?;
    Ok(size)
}

/// Makes a filled placeholder an ordinary object (mode 0644). The marker
/// goes only once its bytes are on disk ([`InPlace::finish`]), so a
/// fill cut short leaves a placeholder, never an object with holes; a
/// mode change lost in a crash leaves one too (filled again, harmlessly).
pub fn seal(target: &OwnedFd) -> io::Result<()> {
    Ok(rfs::fchmod(target, Mode::from_raw_mode(0o644))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placeholder_is_no_object_until_filled() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::create(&tmp.path().join("store")).unwrap();
        let bytes = b"hello, placeholder".repeat(1000);
        let d = tilefs_image::verity::digest_bytes(&bytes);
        assert!(create(&store, &d, bytes.len() as u64).unwrap());
        assert!(!create(&store, &d, bytes.len() as u64).unwrap(), "made once");
        // Its size, its marker; no object to any lookup.
        let st = rfs::stat(store.object_path(&d)).unwrap();
        assert_eq!((st.st_size as usize, st.st_mode & 0o7777), (bytes.len(), MODE));
        assert!(!store.has_object(&d));
        assert_eq!(crate::presence::absent(&store, [d]), vec![d]);
        assert_eq!(list(&store), HashSet::from([d]));
        // Filled: an object like any other, the index swept.
        let src = tmp.path().join("src");
        std::fs::write(&src, &bytes).unwrap();
        let target = rfs::open(store.object_path(&d), OFlags::WRONLY, Mode::empty()).unwrap();
        copy_into(&target, &std::fs::File::open(&src).unwrap()).unwrap();
        rfs::fsync(&target).unwrap();
        assert!(!store.has_object(&d), "a placeholder until sealed");
        seal(&target).unwrap();
        settle(&store, &d, &target).unwrap();
        assert_eq!(std::fs::read(store.object_path(&d)).unwrap(), bytes);
        assert!(store.has_object(&d));
        assert!(crate::presence::absent(&store, [d]).is_empty());
        assert!(list(&store).is_empty());
        assert_eq!(std::fs::read_dir(store.join(PLACEHOLDER_DIR)).unwrap().count(), 0);
        // Replaced by a fetch meanwhile: the filled inode goes back in.
        let d2 = tilefs_image::verity::digest_bytes(b"two");
        assert!(create(&store, &d2, 3).unwrap());
        let target = rfs::open(store.object_path(&d2), OFlags::WRONLY, Mode::empty()).unwrap();
        let fetched = tmp.path().join("fetched");
        std::fs::write(&fetched, b"two").unwrap();
        std::fs::rename(&fetched, store.object_path(&d2)).unwrap();
        copy_into(&target, &std::fs::File::open(store.object_path(&d2)).unwrap()).unwrap();
        seal(&target).unwrap();
        settle(&store, &d2, &target).unwrap();
        let (a, b) = (rfs::fstat(&target).unwrap(), rfs::stat(store.object_path(&d2)).unwrap());
        assert_eq!((a.st_ino, a.st_nlink), (b.st_ino, 1));
        // A fetch fills a placeholder in place: wrong bytes leave it one
        // (emptied), a fill cut short too; the right bytes make it the
        // object, in the same inode.
        let d4 = tilefs_image::verity::digest_bytes(&bytes);
        std::fs::remove_file(store.object_path(&d)).unwrap();
        assert!(create(&store, &d4, bytes.len() as u64).unwrap());
        let inode = rfs::stat(store.object_path(&d4)).unwrap().st_ino;
        let ingest = crate::ingest::Ingest::for_fetched(&store).unwrap();
        let what = std::path::Path::new("fetched");
        let mut wrong = bytes.clone();
        wrong[7] ^= 1;
        let r = ingest.import_expected(what, wrong.len() as u64, &mut &wrong[..], &d4);
        assert!(matches!(r, Err(StoreError::Mismatch(_))), "{r:?}");
        let r = ingest.import_expected(what, bytes.len() as u64, &mut &bytes[..100], &d4);
        assert!(r.is_err(), "ended early");
        let mut cut = fill_in_place(&store, &d4, bytes.len() as u64, false).unwrap();
        io::Write::write_all(&mut cut.file, &bytes[..5000]).unwrap();
        drop(cut);
        assert!(is_at(&store, &d4) && !store.has_object(&d4));
        assert_eq!(std::fs::read(store.object_path(&d4)).unwrap()[..5000], bytes[..5000]);
        ingest
            .import_expected(what, bytes.len() as u64, &mut &bytes[..], &d4)
            .unwrap();
        let st = rfs::stat(store.object_path(&d4)).unwrap();
        assert_eq!((st.st_ino, st.st_mode & 0o7777, st.st_nlink), (inode, 0o644, 1));
        assert_eq!(std::fs::read(store.object_path(&d4)).unwrap(), bytes);
        assert!(store.has_object(&d4) && list(&store).is_empty());
        drop(ingest);

        // Gone unfilled (gc): the entry is swept.
        let d3 = tilefs_image::verity::digest_bytes(b"three");
        assert!(create(&store, &d3, 5).unwrap());
        std::fs::remove_file(store.object_path(&d3)).unwrap();
        assert_eq!(sweep(&store, false), 1);
    }

    #[test]
    fn a_placeholder_is_its_index_entry_and_replaces_a_stale_one() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::create(&tmp.path().join("store")).unwrap();
        let d = tilefs_image::verity::digest_bytes(b"stale");
        let entry = store.join(PLACEHOLDER_DIR).join(hex::encode(d));
        // Left by a crash between a placeholder's listing and its naming.
        std::fs::create_dir_all(entry.parent().unwrap()).unwrap();
        std::fs::write(&entry, b"").unwrap();
        let mut armed = None;
        let maker = Maker::new(&store).unwrap();
        let made = maker
            .create_armed(&d, 5, |fd| {
                // Armed before its object name exists.
                assert!(rfs::stat(store.object_path(&d)).is_err());
                armed = Some(rfs::fstat(fd)?.st_ino);
                Ok(())
            })
            .unwrap();
        assert!(made);
        let (at, listed) = (rfs::stat(store.object_path(&d)).unwrap(), rfs::stat(&entry).unwrap());
        assert_eq!((at.st_ino, at.st_size, at.st_mode & 0o7777), (listed.st_ino, 5, MODE));
        assert_eq!(armed, Some(at.st_ino));
        assert_eq!(list(&store), HashSet::from([d]));
        // An arm that fails leaves nothing.
        let d2 = tilefs_image::verity::digest_bytes(b"refused");
        let refused = maker.create_armed(&d2, 5, |_| Err(io::Error::from_raw_os_error(libc::EPERM)));
        assert!(refused.is_err());
        assert!(rfs::stat(store.object_path(&d2)).is_err());
        assert_eq!(list(&store), HashSet::from([d]));
        assert_eq!(std::fs::read_dir(store.join(PLACEHOLDER_DIR)).unwrap().count(), 1);
    }
}
