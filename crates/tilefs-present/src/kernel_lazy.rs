//! Lazily pulled images served by the kernel: every object not fetched
//! yet is a placeholder in the store (`tilefs_store::placeholder`), marked
//! in a fanotify pre-content group before the kernel mount exists; a
//! filler answers each first open or read of a placeholder by fetching
//! the object through the image's lazy source, checking it, writing it
//! into the placeholder and sealing it, and only then lets the reader in.
//! A filled object's mark is removed: it is read at kernel speed after.
//!
//! Nothing but a fill gets a byte of a placeholder: every open or read
//! of one, by any process and by any path (the mount, its object path,
//! its index link, the filler's own background fetches), waits for a
//! fill, except those of a process holding the placeholder's lock (its
//! `flock`), which only fills take. A filler takes it through the event's
//! descriptor, whose open asked no group (`placeholder::offer`); any other
//! process must open the placeholder first, and that open waits for a
//! fill (unless it came before the group marked the placeholder). Fetches
//! elsewhere (`tilefs pull`) leave served placeholders alone
//! (`placeholder::hold_serving`) and store the object beside: a filler
//! copies it in when it is read.
//!
//! Several lazy mounts of one store each have their group and filler;
//! the placeholders their images share are marked in each group. The
//! kernel asks the groups one after another, so the first fills it and
//! the others find it filled; fills of one placeholder take turns on its
//! lock.
//!
//! Fails closed: the group outlives the filler (the process that forks
//! fillers holds it too), so a dead filler's unanswered events are denied
//! with EIO (`deny_orphans`) and queued ones wait for the next filler: no
//! read of a placeholder is let through unfilled while that holder lives.
//! (The kernel lets reads through once every descriptor of the group is
//! closed: the holder and the filler both killed, or the mount gone with
//! files still open in it.)

use rustix::fd::{AsFd, BorrowedFd};
use rustix::fs::{self as rfs, AtFlags};
use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tilefs_image::tree::Tree;
use tilefs_store::placeholder;
use tilefs_store::remote::ObjectSource;
use tilefs_store::Store;
use tilefs_sys::fanotify::{self, Answer, Event, Group};

/// The highest descriptor number a filler may hold (its limit is set to
/// this), so that the events of a dead one can all be answered.
pub const FD_LIMIT: u64 = 8192;
/// Opens (any: read, mmap, exec) and reads of a placeholder.
const MASK: u64 = fanotify::OPEN_PERM | fanotify::PRE_ACCESS;
/// Fills at once (each may wait for a registry).
const FILLERS: usize = 16;

/// The objects of `tree` (object path digest, size), once each.
fn objects(tree: &Tree) -> Result<HashMap<[u8; 32], u64>, String> {
    let mut out = HashMap::new();
    for i in tree.inodes.iter().filter(|i| i.is_external()) {
        let Some(p) = i.payload.as_deref().filter(|p| !p.is_empty()) else {
            continue;
        };
        let d = tilefs_store::parse_object_rel(p).ok_or_else(|| {
            "its files are named by SHA-256 until fetched (pulled from tables of contents)".to_string()
        })?;
        out.insert(d, i.size);
    }
    Ok(out)
}

/// Why `tree`, a lazily pulled image, cannot be mounted by the kernel
/// from the store at `store` (None: it can).
pub fn why_not(store: &Path, tree: &Tree) -> Option<String> {
    if let Err(why) = objects(tree) {
        return Some(why);
    }
    let probe = fanotify::supports_pre_content(store).err()?;
    Some(match probe.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENODEV) | Some(libc::EXDEV) => format!(
            "the store's filesystem ({}) takes no fanotify pre-content marks",
            store.display()
        ),
        Some(libc::EINVAL) => "the kernel has no fanotify pre-content events (Linux 6.14 or later has)".into(),
        Some(libc::EPERM) => "fanotify pre-content events need privilege".into(),
        _ => format!("no fanotify pre-content events on {}: {probe}", store.display()),
    })
}

/// An image's placeholders, made and marked: events queue in the group
/// from here on (even before a filler reads them).
pub struct Armed {
    group: Group,
    /// Says to fills elsewhere that placeholders are served here
    /// (`placeholder::hold_serving`).
    _serving: rustix::fd::OwnedFd,
    store: PathBuf,
    image: [u8; 32],
    /// Each marked placeholder's (device, inode): its object and size.
    marked: HashMap<(u64, u64), ([u8; 32], u64)>,
}

impl Armed {
    /// Makes a placeholder of every object of `tree` the store lacks and
    /// marks it, before any mount of the image exists.
    pub fn arm(store: &Store, image: [u8; 32], tree: &Tree) -> Result<Armed, String> {
        let group = Group::new().map_err(|e| format!("cannot make a fanotify group: {e}"))?;
        let serving = placeholder::hold_serving(store).map_err(|e| format!("{}: {e}", store.path().display()))?;
        let mut marked = HashMap::new();
        let maker = placeholder::Maker::new(store).map_err(|e| e.to_string())?;
        let objects = objects(tree)?;
        // Those the store lacks or has as placeholders, from listings of
        // its fan-out directories rather than a lookup each.
        let todo = tilefs_store::presence::absent(store, objects.keys().copied());
        for (d, size) in todo.into_iter().map(|d| (d, objects[&d])) {
            // Marked before it is named: nothing can reach it unmarked.
            let mut made_as = None;
            let made = maker
                .create_armed(&d, size, |fd| {
                    group.mark_inode(fd, MASK)?;
                    let st = rfs::fstat(fd)?;
                    made_as = Some((st.st_dev, st.st_ino));
                    Ok(())
                })
                .map_err(|e| e.to_string())?;
            if let (true, Some(key)) = (made, made_as) {
                marked.insert(key, (d, size));
                continue;
            }
            // The store has it: another mount's placeholder (marked in this
            // group too), or an object stored meanwhile.
            let rel = Store::object_rel(&d);
            let stat = || rfs::statat(store.dir_fd(), &rel, AtFlags::SYMLINK_NOFOLLOW).ok();
            let Some(st) = stat().filter(placeholder::is_placeholder) else {
                continue; // stored meanwhile
            };
            let path = CString::new(rel.as_str()).expect("no NUL in an object path");
            group
                .mark_at(store.dir_fd(), &path, MASK)
                .map_err(|e| format!("{}: cannot mark: {e}", store.join(&rel).display()))?;
            // The inode marked is the one stat saw, unless it was replaced
            // between (by a fetched object: then nothing is to fill).
            if stat().is_some_and(|again| (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino)) {
                marked.insert((st.st_dev, st.st_ino), (d, size));
            }
        }
        Ok(Armed {
            group,
            _serving: serving,
            store: store.path().to_path_buf(),
            image,
            marked,
        })
    }

    /// Once the mount is gone: refuses what the last filler left waiting,
    /// and drops the index entries of placeholders fetched meanwhile by
    /// other means (read-ahead: a neighbour's fetch stored them).
    pub fn finish(&self) {
        deny_orphans(&self.group);
        if let Ok(store) = Store::open(&self.store) {
            placeholder::sweep(&store, false);
        }
    }

    /// The group (the holder keeps it open while fillers come and go).
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Fills placeholders as they are first opened or read, until
    /// `mounted` says the mount is gone; with `rest` (bytes a second), also
    /// the others in the background ([`Armed::fetch_rest`]). `log` gets a
    /// line per failure. The calling process fills placeholders only
    /// through event descriptors from here on
    /// (`placeholder::fill_only_through_offers`): run it in a process of
    /// its own.
    pub fn fill(
        &self,
        mounted: &dyn Fn() -> bool,
        rest: Option<u64>,
        log: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> Result<(), String> {
        // Without a source, every fill fails (EIO) saying why.
        let source = tilefs_oci::toc_lazy::open_source(&self.store, &self.image).unwrap_or_else(|e| {
            log(&format!("{}: {e}: objects cannot be fetched", self.store.display()));
            None
        });
        let store = Store::open(&self.store).map_err(|e| e.to_string())?;
        placeholder::fill_only_through_offers();
        let waiting: Mutex<HashMap<(u64, u64), Vec<Event>>> = Mutex::new(HashMap::new());
        let (tx, rx) = mpsc::channel::<(u64, u64)>();
        let rx = Mutex::new(rx);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..FILLERS {
                s.spawn(|| loop {
                    let Ok(key) = rx.lock().unwrap().recv() else {
                        return;
                    };
                    let (digest, size) = self.marked[&key];
                    // Any waiting event's descriptor reaches the inode.
                    let event = waiting.lock().unwrap()[&key][0].fd.try_clone();
                    let filled = event.map_err(|e| e.to_string()).and_then(|fd| {
                        let filled = fill_one(&store, source.as_deref(), fd.as_fd(), &digest, size);
                        let _ = rfs::flock(&fd, rfs::FlockOperation::Unlock);
                        filled
                    });
                    let events = waiting.lock().unwrap().remove(&key).unwrap_or_default();
                    let answer = match &filled {
                        Ok(()) => {
                            let _ = self.group.unmark_inode(events[0].fd.as_fd(), MASK);
                            Answer::Allow
                        }
                        Err(why) => {
                            log(&format!(
                                "{}: {why}; {} read(s) answered EIO, the placeholder stays",
                                store.object_path(&digest).display(),
                                events.len()
                            ));
                            Answer::Deny(libc::EIO)
                        }
                    };
                    for e in events {
                        let _ = self.group.answer(e, answer);
                    }
                });
            }
            // The registry client started now, not at the first reader's.
            if let Some(source) = source.as_deref() {
                s.spawn(move || source.warm());
            }
            if let (Some(rate), Some(_)) = (rest, source.as_deref()) {
                let (store, stop, log) = (&store, &stop, log.clone());
                s.spawn(move || self.fetch_rest(store, rate, stop, &*log));
            }
            let served = self.serve_events(mounted, &waiting, &tx);
            stop.store(true, Relaxed);
            drop(tx);
            served
        })
    }

    /// Fetches every placeholder no reader asked for yet, one object after
    /// another at no more than `rate` bytes a second on average, until all
    /// are filled or `stop`. Each is opened as a reader would, so its fill
    /// is a reader's (a reader of it meanwhile waits for that fill, not a
    /// second one); the readers of other objects never wait for these
    /// (their fills run on other threads).
    fn fetch_rest(&self, store: &Store, rate: u64, stop: &AtomicBool, log: &dyn Fn(&str)) {
        let mut todo: Vec<([u8; 32], u64)> = self.marked.values().copied().collect();
        todo.sort_unstable();
        let (start, mut sent, mut failed) = (Instant::now(), 0u64, 0usize);
        for (digest, size) in todo {
            let due = Duration::from_secs_f64(sent as f64 / rate.max(1) as f64);
            while start.elapsed() < due {
                if stop.load(Relaxed) {
                    return;
                }
                std::thread::sleep((due - start.elapsed()).min(Duration::from_millis(100)));
            }
            if stop.load(Relaxed) {
                return;
            }
            if !placeholder::is_at(store, &digest) {
                continue;
            }
            let rel = Store::object_rel(&digest);
            match rfs::openat(
                store.dir_fd(),
                &rel,
                rfs::OFlags::RDONLY | rfs::OFlags::CLOEXEC,
                rfs::Mode::empty(),
            ) {
                Ok(_) => sent += size,
                // (The fill said why.)
                Err(_) => failed += 1,
            }
        }
        log(&format!(
            "{}: the rest of the image fetched in the background ({sent} bytes in {:.1} s; {failed} failed)",
            self.store.display(),
            start.elapsed().as_secs_f64()
        ));
    }

    /// Reads events until the mount is gone: those of a placeholder wait
    /// for its fill (one per placeholder however many wait), but a fill's
    /// own (see the module's note).
    fn serve_events(
        &self,
        mounted: &dyn Fn() -> bool,
        waiting: &Mutex<HashMap<(u64, u64), Vec<Event>>>,
        fills: &mpsc::Sender<(u64, u64)>,
    ) -> Result<(), String> {
        let fail = |e: std::io::Error| format!("fanotify: {e}");
        while mounted() {
            let mut fds = [rustix::event::PollFd::new(&self.group, rustix::event::PollFlags::IN)];
            let timeout = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 300_000_000,
            };
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(fail(e.into())),
            }
            for e in self.group.read_events().map_err(fail)? {
                let st = rfs::fstat(&e.fd).map_err(|err| fail(err.into()))?;
                let key = (st.st_dev, st.st_ino);
                if !placeholder::is_placeholder(&st) {
                    // Filled already (by another mount's filler, or here).
                    let _ = self.group.unmark_inode(e.fd.as_fd(), MASK);
                    self.group.answer(e, Answer::Allow).map_err(fail)?;
                    continue;
                }
                let answer = if !self.marked.contains_key(&key) {
                    // Not one this group made: nothing here can fill it.
                    Some(Answer::Deny(libc::EIO))
                } else if is_fill(&e, key) {
                    Some(Answer::Allow)
                } else {
                    None
                };
                if let Some(answer) = answer {
                    self.group.answer(e, answer).map_err(fail)?;
                    continue;
                }
                let mut w = waiting.lock().unwrap();
                let list = w.entry(key).or_default();
                list.push(e);
                if list.len() == 1 {
                    let _ = fills.send(key);
                }
            }
        }
        Ok(())
    }
}

/// Whether an event is an access of a fill in another process: one that
/// holds the placeholder's lock (`placeholder::fill_in_place`), taken
/// through a descriptor whose open was itself asked (and so waited for a
/// fill, unless it came before the group marked it). Anything else, root
/// reading the placeholder through its index link included, waits.
fn is_fill(e: &Event, (dev, ino): (u64, u64)) -> bool {
    fanotify::flock_holders(dev, ino).is_ok_and(|pids| pids.contains(&e.pid))
}

/// Answers EIO to every event a dead filler read and left unanswered
/// (the kernel knows them by the descriptor numbers that filler had, all
/// below [`FD_LIMIT`]; numbers of no event are refused, harmlessly).
pub fn deny_orphans(group: &Group) -> usize {
    (0..FD_LIMIT as i32)
        .filter(|&fd| group.answer_raw(fd, Answer::Deny(libc::EIO)).is_ok())
        .count()
}

/// Limits this process's descriptors to [`FD_LIMIT`] (a filler's).
pub fn limit_fds() -> std::io::Result<()> {
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(FD_LIMIT),
            maximum: Some(FD_LIMIT),
        },
    )
    .map_err(Into::into)
}

/// Fills the placeholder reached by the event descriptor `event` with
/// the object `digest`. The fetch writes it straight into the
/// placeholder, checked as it is written (`Ingest::import_expected`); an object the
/// fetch stored beside it instead (a layer read whole, a fetch of another
/// process) is copied in, read back and checked. Then sealed and named.
fn fill_one(
    store: &Store,
    source: Option<&dyn ObjectSource>,
    event: BorrowedFd<'_>,
    digest: &[u8; 32],
    size: u64,
) -> Result<(), String> {
    let unfilled = || {
        rfs::fstat(event)
            .map(|st| placeholder::is_placeholder(&st))
            .map_err(|e| e.to_string())
    };
    if !unfilled()? {
        return Ok(());
    }
    // Its lock, taken through a descriptor no group was asked for: with it
    // every group lets this process's accesses through (`is_fill`), and
    // fills elsewhere wait for this one.
    rfs::flock(event, rfs::FlockOperation::LockExclusive).map_err(|e| format!("cannot lock it: {e}"))?;
    if !unfilled()? {
        return Ok(());
    }
    let _offered = placeholder::offer(digest, event).map_err(|e| e.to_string())?;
    if !store.has_object(digest) {
        let source = source.ok_or("the image's lazy-pull record is gone, so nothing can fetch it")?;
        source.fetch(digest, size)?;
    }
    if !unfilled()? {
        return Ok(());
    }
    // Stored beside it instead: copied in, once a fill of another process
    // (which made this fetch store it beside) is done.
    let Some(fill) = placeholder::fill_in_place(store, digest, size, true) else {
        return match unfilled()? {
            false => Ok(()),
            true => Err("cannot fill its placeholder (not of its size?)".into()),
        };
    };
    let rel = Store::object_rel(digest);
    let object = tilefs_store::open_regular(store.dir_fd(), Path::new(&rel), false)
        .map_err(|e| format!("the fetched object: {e}"))?;
    let filled = placeholder::copy_into(&fill.file, &object)
        .map_err(|e| format!("cannot fill it: {e}"))
        .and_then(|_| check(&fill.file, digest));
    if let Err(why) = filled {
        fill.abandon();
        return Err(why);
    }
    fill.finish(store, digest, |fd| {
        let _ = tilefs_sys::verity::enable(fd);
    })
    .map_err(|e| format!("cannot seal it: {e}"))
}

/// Whether the placeholder now holds the object `digest` (read back: the
/// reader gets exactly these bytes).
fn check(target: &std::fs::File, digest: &[u8; 32]) -> Result<(), String> {
    let f = target.try_clone().map_err(|e| e.to_string())?;
    match tilefs_image::verity::digest_file(&f, |_| {}) {
        Ok(d) if d == *digest => Ok(()),
        Ok(_) => Err("its bytes, as written, do not match its fs-verity digest".into()),
        Err(e) => Err(format!("cannot read it back: {e}")),
    }
}

/// Whether the mount whose id is `id` is still at `mountpoint`.
pub fn still_mounted(mountpoint: &Path, id: u64) -> bool {
    tilefs_store::mounts::mount_id_of(mountpoint) == Some(id)
}

/// Waits a little between restarts of a filler that keeps dying.
pub fn backoff(restarts: u32) -> Duration {
    Duration::from_millis(100u64 << restarts.min(5))
}

/// Why [`mount_erofs_alone`] mounted nothing.
#[derive(Debug)]
pub enum NotMounted {
    /// The kernel cannot fill this image's placeholders here (the
    /// machine's or the store's lack, the same for every image of the
    /// kind: said once, see [`why_not`]).
    Unable(String),
    /// The mount failed.
    Failed(String),
}

impl std::fmt::Display for NotMounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotMounted::Unable(m) | NotMounted::Failed(m) => f.write_str(m),
        }
    }
}

/// For the containerd snapshotter: the image file `image`, pulled lazily
/// into `store`, mounted by the kernel at `mountpoint` as EROFS alone
/// (read-only), its files' data read by the container's overlay, which
/// has the store as its data-only lower (as the snapshotter's images that
/// are not lazy are). Its placeholders made and marked first, as
/// [`Armed::arm`] does. The mount's id, and the armed group to fill from
/// (None: the store lacks nothing of it).
pub fn mount_erofs_alone(store: &Store, image: &Path, mountpoint: &Path) -> Result<(Option<Armed>, u64), NotMounted> {
    let failed = |e: String| NotMounted::Failed(format!("{}: {e}", image.display()));
    let mut bytes = Vec::new();
    tilefs_store::open_regular(rustix::fs::CWD, image, true)
        .and_then(|mut f| std::io::Read::read_to_end(&mut f, &mut bytes))
        .map_err(|e| failed(e.to_string()))?;
    let armed = match tilefs_store::remote::incomplete(store, &bytes) {
        None => None,
        Some(missing) => {
            let (tree, _) = tilefs_image::erofs::read_image(&bytes).map_err(|e| failed(e.to_string()))?;
            if let Some(why) = why_not(store.path(), &tree) {
                return Err(NotMounted::Unable(why));
            }
            // Its lazy-pull record judged now (one not root's refuses the
            // mount), not at every read.
            tilefs_oci::toc_lazy::open_source(store.path(), &missing.digest).map_err(|e| failed(e.to_string()))?;
            Some(Armed::arm(store, missing.digest, &tree).map_err(failed)?)
        }
    };
    tilefs_mount::mount_erofs_at(image, mountpoint, tilefs_mount::ErofsBacking::Auto)
        .map_err(|e| failed(e.to_string()))?;
    let id = tilefs_store::mounts::mount_id_of(mountpoint).ok_or_else(|| {
        let _ = rustix::mount::unmount(mountpoint, rustix::mount::UnmountFlags::DETACH);
        failed(format!("{}: no mount there", mountpoint.display()))
    })?;
    Ok((armed, id))
}
