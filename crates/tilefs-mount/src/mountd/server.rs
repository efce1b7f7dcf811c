//! The service: checks each caller against the policy and builds the
//! kernel mount of a trusted image for it, detached, always nosuid and
//! nodev, and never able to do for the caller what the caller's own
//! credentials could not:
//!
//! - a read-only mount is attached at a directory the caller owns, may
//!   write and can reach (see [`checks`](super::checks)), held by
//!   descriptor from the client's open to the attach; or, for a client in
//!   a user namespace of its own, handed back with its flags locked;
//! - a writable mount is the overlay a rootless user would make (see
//!   [`helper`](super::helper)): created with the caller's credentials in a
//!   user namespace that maps only the caller, over the read-only mount.
//!
//! Every request and refusal is logged with the caller, escaped;
//! connections turned away before they asked anything are counted and
//! logged at most once a minute in all ([`Tally`]).
//!
//! No request holds up another's. Whatever touches a path the caller
//! chose (its mount point, upper and work directories: a FUSE directory
//! of the caller's that never answers blocks any system call on it, and
//! nothing but the end of that connection interrupts one) runs on a
//! thread of the request's own, holding no lock another request needs.
//! The client's connection waits for it up to the request's deadline
//! (`--request-timeout`), watching for the client hanging up; then the
//! client is answered and the request abandoned: if its thread ever
//! returns, it does nothing more (a mount it attached meanwhile is
//! detached again). Such a thread keeps its user's request slot, so a
//! user has at most [`MAX_CLIENTS_PER_USER`] of them, and no other user
//! is affected.

use super::checks::{self, STATX_MNT_ID_UNIQUE};
use super::helper::{self, HelperCommand, Ids, WritableLayers};
use super::policy::{Caller, Policy};
use super::proto::{self, Reply, Request};
use crate::{build_detached, MountAttrs, MountOptions, Verity};
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, Mode, OFlags, StatxFlags};
use rustix::io::Errno;
use rustix::mount::MoveMountFlags;
use rustix::net::{SocketFlags, SocketType};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub const DEFAULT_SOCKET: &str = "/run/tilefs/mountd.sock";
pub const DEFAULT_POLICY: &str = "/etc/tilefs/mountd.toml";
/// Mounts made for users, by unique mount id: a file holding the uid. The
/// helper also mounts its scratch space here, in its private namespace.
const RECORDS: &str = "/run/tilefs/mountd";
/// Requests served at once; more are refused (busy), not queued.
const MAX_CLIENTS: usize = 64;
/// Requests of one user served at once.
const MAX_CLIENTS_PER_USER: usize = 4;
/// Live mounts the service keeps for one user, unless the policy says.
const DEFAULT_MAX_MOUNTS_PER_USER: usize = 64;
/// A client has this long to send its request and take its reply.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request may take once read, unless the service is told.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// What a request's thread says when its client no longer waits.
const GONE: &str = "its client no longer waits for it";

/// What the service is started with.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen (unless systemd passes a socket).
    pub socket: PathBuf,
    pub policy: PathBuf,
    /// How to run the helper (`tilefs mountd --helper`).
    pub helper: HelperCommand,
    /// How long a request may take once read (its checks, building and
    /// attaching the mount) before its client is told it did not finish.
    pub request_timeout: Duration,
}

/// The service, bound and ready to serve.
pub struct Service {
    listener: OwnedFd,
    /// The socket file this service created (removed at shutdown); none
    /// when systemd passed the socket.
    bound: Option<PathBuf>,
    policy: Policy,
    helper: HelperCommand,
    request_timeout: Duration,
    slots: Mutex<Slots>,
    /// Directories a mount is being attached at, by device and inode: a
    /// second request for one of them meanwhile is refused, never queued
    /// (nor stacked on the first).
    targets: Mutex<HashSet<(u64, u64)>>,
    /// Mounts between their last check and their record: shutdown waits
    /// for them (briefly).
    attaching: Mutex<usize>,
    attached: Condvar,
    /// Set at shutdown: no mount is attached from then on.
    closing: AtomicBool,
    turned_away: Tally,
}

#[derive(Default)]
struct Slots {
    /// Connections being served.
    connections: usize,
    /// Requests of each user not finished: connections being served, and
    /// the threads of requests whose client was answered before they
    /// ended.
    by_uid: HashMap<u32, usize>,
}

/// A connection being served; frees its place when dropped.
struct ConnSlot<'a>(&'a Service);

impl Drop for ConnSlot<'_> {
    fn drop(&mut self) {
        self.0.slots.lock().unwrap_or_else(|e| e.into_inner()).connections -= 1;
    }
}

/// A request of a user, from its connection to the end of its thread;
/// frees its place when dropped (also when that thread panics).
struct UserSlot {
    svc: Arc<Service>,
    uid: u32,
}

impl Drop for UserSlot {
    fn drop(&mut self) {
        let mut s = self.svc.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = s.by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                s.by_uid.remove(&self.uid);
            }
        }
    }
}

/// A request carried out on a thread of its own, and whether its client
/// still waits for its result.
#[derive(Default)]
struct Job(Mutex<Phase>);

#[derive(Default, PartialEq)]
enum Phase {
    #[default]
    Running,
    /// The client was answered (deadline) or hung up: nothing more is done.
    Abandoned,
    /// Past the point of no return: the client gets the result.
    Committed,
}

impl Job {
    fn abandoned(&self) -> bool {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) == Phase::Abandoned
    }

    /// Called by the request's thread when it is about to do what cannot
    /// be undone, or has done what it will undo otherwise: whether the
    /// client still waits (then it waits for the result, however late).
    fn commit(&self) -> bool {
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if *p == Phase::Abandoned {
            return false;
        }
        *p = Phase::Committed;
        true
    }

    /// Called by the connection when it stops waiting: false if the
    /// request was committed (its result is coming).
    fn abandon(&self) -> bool {
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if *p == Phase::Committed {
            return false;
        }
        *p = Phase::Abandoned;
        true
    }
}

/// A directory claimed for one attach; released when dropped.
struct Claim<'a> {
    svc: &'a Service,
    key: (u64, u64),
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.svc
            .targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

/// A mount between its last check and its record.
struct Attaching<'a>(&'a Service);

impl Drop for Attaching<'_> {
    fn drop(&mut self) {
        *self.0.attaching.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0.attached.notify_all();
    }
}

/// Connections turned away before they asked anything (idle, of users the
/// policy does not name, beyond a user's share): counted, and logged in
/// one line at most once a minute, so that no client can flood the log.
#[derive(Default)]
struct Tally(Mutex<Counts>);

#[derive(Default)]
struct Counts {
    /// When the last line was logged.
    last: Option<Instant>,
    unlisted: u64,
    /// Their uids (the first few).
    unlisted_uids: BTreeSet<u32>,
    busy: u64,
    idle: u64,
    anonymous: u64,
}

enum TurnedAway {
    Unlisted(u32),
    Busy,
    Idle,
    /// No credentials could be read.
    Anonymous,
}

const TALLY_EVERY: Duration = Duration::from_secs(60);

impl Tally {
    fn note(&self, why: TurnedAway) {
        let mut c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match why {
            TurnedAway::Unlisted(uid) => {
                c.unlisted += 1;
                if c.unlisted_uids.len() < 8 {
                    c.unlisted_uids.insert(uid);
                }
            }
            TurnedAway::Busy => c.busy += 1,
            TurnedAway::Idle => c.idle += 1,
            TurnedAway::Anonymous => c.anonymous += 1,
        }
        c.log_if_due();
    }

    /// How long until a line may be logged again.
    fn due_in(&self) -> Duration {
        let c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        c.last.map_or(TALLY_EVERY, |t| TALLY_EVERY.saturating_sub(t.elapsed()))
    }

    /// Logs what was counted since the last line, if a line is due.
    fn flush_due(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).log_if_due();
    }

    /// What was counted and not logged yet, taken (for the last line).
    fn rest(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl Counts {
    fn log_if_due(&mut self) {
        if self.last.is_none_or(|t| t.elapsed() >= TALLY_EVERY) {
            if let Some(line) = self.take() {
                tracing::warn!("connections turned away (counted, a line a minute at most): {line}");
            }
        }
    }

    /// The counts as a line's text, reset; None when there are none.
    fn take(&mut self) -> Option<String> {
        let mut parts = Vec::new();
        if self.unlisted > 0 {
            let uids: Vec<String> = self.unlisted_uids.iter().map(u32::to_string).collect();
            parts.push(format!(
                "{} of users the policy does not name (uid {})",
                self.unlisted,
                uids.join(", ")
            ));
        }
        if self.busy > 0 {
            parts.push(format!("{} beyond their user's share (busy)", self.busy));
        }
        if self.idle > 0 {
            parts.push(format!("{} idle (no request within {CLIENT_TIMEOUT:?})", self.idle));
        }
        if self.anonymous > 0 {
            parts.push(format!("{} without credentials", self.anonymous));
        }
        if parts.is_empty() {
            return None;
        }
        *self = Counts {
            last: Some(Instant::now()),
            ..Counts::default()
        };
        Some(parts.join(", "))
    }
}

impl Service {
    /// Loads the policy and listens: on the socket systemd passed
    /// (`LISTEN_FDS`), else on `config.socket` (created, mode 0666: the
    /// policy, not the socket's mode, decides who gets what).
    pub fn bind(config: &Config) -> Result<Service, String> {
        if !rustix::process::geteuid().is_root() {
            return Err("the mount service must run as root".into());
        }
        let policy = Policy::load(&config.policy)?;
        std::fs::create_dir_all(RECORDS).map_err(|e| format!("{RECORDS}: {e}"))?;
        let (listener, bound) = match activated_socket() {
            Some(fd) => (fd, None),
            None => (bind(&config.socket)?, Some(config.socket.clone())),
        };
        tracing::info!(
            "serving {} with policy {} ({} stores)",
            config.socket.display(),
            config.policy.display(),
            policy.stores.len()
        );
        Ok(Service {
            listener,
            bound,
            policy,
            helper: config.helper.clone(),
            request_timeout: config.request_timeout,
            slots: Mutex::new(Slots::default()),
            targets: Mutex::new(HashSet::new()),
            attaching: Mutex::new(0),
            attached: Condvar::new(),
            closing: AtomicBool::new(false),
            turned_away: Tally::default(),
        })
    }

    /// Serves clients until the process ends. A failed accept (out of
    /// descriptors or memory) is waited out, never the end of the service.
    pub fn serve(self: &Arc<Self>) -> Result<(), String> {
        let svc = self.clone();
        let _ = std::thread::Builder::new()
            .name("mountd-tally".into())
            .spawn(move || loop {
                std::thread::sleep(svc.turned_away.due_in().max(Duration::from_secs(1)));
                svc.turned_away.flush_due();
            });
        let mut last_complaint: Option<Instant> = None;
        loop {
            let conn = match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC) {
                Ok(c) => c,
                Err(Errno::INTR) | Err(Errno::CONNABORTED) | Err(Errno::AGAIN) => continue,
                Err(e @ (Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM | Errno::PERM)) => {
                    if last_complaint.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        tracing::warn!("accept: {e}; waiting for resources");
                        last_complaint = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                Err(e) => return Err(format!("accept: {e}")),
            };
            let svc = self.clone();
            let spawned = std::thread::Builder::new()
                .name("mountd-client".into())
                .spawn(move || svc.client(conn));
            if let Err(e) = spawned {
                tracing::warn!("cannot start a thread: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Ends the service: no mount is attached from now on; waits (2 s at
    /// most) for mounts being attached to be recorded, removes the socket
    /// file it created and logs it. The caller then exits.
    pub fn shutdown(&self, why: &str) {
        self.closing.store(true, Ordering::SeqCst);
        let n = self.attaching.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self
            .attached
            .wait_timeout_while(n, Duration::from_secs(2), |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &self.bound {
            let _ = std::fs::remove_file(p);
        }
        match self.turned_away.rest() {
            Some(rest) => tracing::warn!("shutting down ({why}); connections turned away since the last count: {rest}"),
            None => tracing::info!("shutting down ({why})"),
        }
    }

    /// One connection: who it is, a slot for it, its request.
    fn client(self: &Arc<Self>, conn: OwnedFd) {
        use rustix::net::sockopt;
        let _ = sockopt::set_socket_timeout(&conn, sockopt::Timeout::Recv, Some(CLIENT_TIMEOUT));
        let _ = sockopt::set_socket_timeout(&conn, sockopt::Timeout::Send, Some(CLIENT_TIMEOUT));
        let Ok(caller) = peer(&conn) else {
            return self.turned_away.note(TurnedAway::Anonymous);
        };
        // Users the policy does not name are answered at once, before they
        // can hold a slot.
        if !self.policy.lists(&caller) {
            self.turned_away.note(TurnedAway::Unlisted(caller.uid));
            let _ = reply(
                &conn,
                Err(format!("uid {} may not use this mount service", caller.uid)),
                None,
            );
            return;
        }
        let Some((_conn_slot, user_slot)) = self.slot(caller.uid) else {
            self.turned_away.note(TurnedAway::Busy);
            let _ = send_reply(&conn, &Reply::busy("the mount service is busy; try again"), None);
            return;
        };
        self.request(conn, caller, user_slot);
    }

    fn slot(self: &Arc<Self>, uid: u32) -> Option<(ConnSlot<'_>, UserSlot)> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mine = s.by_uid.get(&uid).copied().unwrap_or(0);
        if s.connections >= MAX_CLIENTS || mine >= MAX_CLIENTS_PER_USER {
            return None;
        }
        s.connections += 1;
        *s.by_uid.entry(uid).or_default() += 1;
        Some((ConnSlot(self), UserSlot { svc: self.clone(), uid }))
    }

    /// Reads the request, has it carried out on a thread of its own (which
    /// keeps the user's slot until it ends) and answers it.
    fn request(self: &Arc<Self>, conn: OwnedFd, caller: Caller, slot: UserSlot) {
        let who = format!("uid {} (pid {})", caller.uid, caller.pid);
        let got = match proto::recv(&conn) {
            Ok((bytes, fds)) => Request::parse(&bytes).map(|req| (req, fds)),
            Err(Errno::AGAIN) => return self.turned_away.note(TurnedAway::Idle),
            Err(Errno::MFILE) => {
                tracing::warn!("{who}: refused: no descriptors left for the ones the request carried");
                let _ = send_reply(
                    &conn,
                    &Reply::busy("the mount service is busy (out of descriptors); try again"),
                    None,
                );
                return;
            }
            Err(Errno::MSGSIZE) => Err(format!("the request is larger than {} bytes", proto::MAX_MESSAGE)),
            Err(e) => return tracing::warn!("{who}: cannot read the request: {e}"),
        };
        let conn = Arc::new(conn);
        let result = match got {
            Ok((req, fds)) => match self.carry_out(&conn, caller, req, fds, slot, &who) {
                Some(r) => r,
                None => {
                    return tracing::warn!("{who}: the client hung up before its request was done: not carried out")
                }
            },
            Err(e) => Err(e),
        };
        let (result, back) = match result {
            Ok((notices, back)) => (Ok(notices), back),
            // Whatever failed, it may have failed for want of descriptors:
            // then the request is not refused, the service is busy.
            Err(e) if out_of_descriptors() => {
                tracing::warn!("{who}: busy: {e}");
                let _ = send_reply(
                    &*conn,
                    &Reply::busy(format!("the mount service is busy ({e}); try again")),
                    None,
                );
                return;
            }
            Err(e) => {
                tracing::warn!("{who}: refused: {e}");
                (Err(e), None)
            }
        };
        if let Err(e) = reply(&*conn, result, back.as_ref()) {
            tracing::warn!("{who}: cannot send the reply: {e}");
        }
    }

    /// Carries out `req` on a thread of its own and waits for it, up to
    /// the request's deadline, while the client is there; None when the
    /// client hung up first. Past the deadline the result is an error,
    /// and whatever the thread does later is undone or not done.
    fn carry_out(
        self: &Arc<Self>,
        conn: &Arc<OwnedFd>,
        caller: Caller,
        req: Request,
        fds: Vec<OwnedFd>,
        slot: UserSlot,
        who: &str,
    ) -> Option<Result<Handled, String>> {
        let job = Arc::new(Job::default());
        let (tx, rx) = mpsc::channel();
        let (svc, conn2, job2, who2) = (self.clone(), conn.clone(), job.clone(), who.to_string());
        let spawned = std::thread::Builder::new().name("mountd-request".into()).spawn(move || {
            let _slot = slot;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                svc.handle(&caller, &conn2, req, fds, &job2)
            }))
            .unwrap_or_else(|_| {
                tracing::warn!("{who2}: internal error serving the request");
                Err("internal error in the mount service".into())
            });
            if job2.abandoned() {
                let how = r.as_ref().err().map_or("done", String::as_str);
                tracing::warn!(
                    "{who2}: a request ended after its client was answered or had hung up; nothing was done for it ({how})"
                );
            }
            let _ = tx.send(r);
        });
        if let Err(e) = spawned {
            tracing::warn!("{who}: cannot start a thread: {e}");
            return Some(Err("the mount service is busy (no thread); try again".into()));
        }
        let deadline = Instant::now() + self.request_timeout;
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => return Some(r),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Some(Err("internal error in the mount service".into()))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            let hung_up = hung_up(conn);
            if (hung_up || Instant::now() >= deadline) && job.abandon() {
                if hung_up {
                    return None;
                }
                return Some(Err(format!(
                    "the request did not finish within {}s (a directory it names does not answer, or the system is overloaded); nothing was done for it",
                    self.request_timeout.as_secs()
                )));
            }
        }
    }

    fn handle(
        &self,
        caller: &Caller,
        conn: &OwnedFd,
        req: Request,
        fds: Vec<OwnedFd>,
        job: &Job,
    ) -> Result<Handled, String> {
        let who = format!("uid {} (pid {})", caller.uid, caller.pid);
        let mut fds = fds.into_iter();
        match req {
            Request::Mount {
                store,
                image,
                attach,
                noexec,
                nosymfollow,
                verity,
                upper,
            } => {
                let rule = self.policy.allow(caller, &store, &image)?;
                if upper && !rule.writable {
                    return Err(format!(
                        "the policy does not allow writable mounts of store {}",
                        store.display()
                    ));
                }
                let target = if attach {
                    let t = fds.next().ok_or("no mount point came with the request")?;
                    // Refused before anything is built.
                    checks::mount_point(caller, t.as_fd())?;
                    self.room_for_one_more(caller.uid)?;
                    Some(t)
                } else {
                    // A detached mount is for a client that will attach it
                    // in a mount namespace of its own, never in the
                    // service's (where nobody would know it is theirs).
                    let pidfd = peer_pidfd(conn)?;
                    if in_initial_user_namespace(caller, &pidfd)? {
                        return Err("only a client in a user namespace of its own takes the mount detached; in the initial namespace the service attaches it".into());
                    }
                    None
                };
                let layers = if upper {
                    let (u, w) = fds
                        .next()
                        .zip(fds.next())
                        .ok_or("no upper and work directories came with the request")?;
                    check_layers(caller, u.as_fd(), w.as_fd())?;
                    Some(WritableLayers {
                        upper: u,
                        work: w,
                        caller_pidfd: peer_pidfd(conn)?,
                    })
                } else {
                    None
                };
                tilefs_store::tags::validate_tag(&image).map_err(|e| e.to_string())?;
                let image_path = rule.path.join(tilefs_store::store::IMAGES_DIR).join(&image);
                let file = open_tag(&rule.path, &image)?;
                // The policy's verity wins over the request's, where it says one.
                let verity: Verity = match (&rule.verity, &verity) {
                    (Some(v), _) | (None, Some(v)) => v.parse()?,
                    (None, None) => Verity::Auto,
                };
                let mut digest = match rule.pinned.get(&image) {
                    Some(d) => Some(crate::options::parse_digest(d)?),
                    None => None,
                };
                // A store whose rule names a signature policy: the image
                // is mounted only if that policy accepts it, judged by the
                // record its pull kept, and exactly those bytes are mounted.
                if let Some(policy_path) = &rule.signature_policy {
                    let judged = signature_check(&rule.path, &image, &file, policy_path)?;
                    if digest.is_some_and(|d| d != judged) {
                        return Err(format!(
                            "{image}: the image is not the one the policy pins in store {}",
                            store.display()
                        ));
                    }
                    digest = Some(judged);
                }
                let attrs = MountAttrs {
                    nosuid: true,
                    nodev: true,
                    noexec,
                    nosymfollow,
                    ..MountAttrs::default()
                };
                let o = MountOptions {
                    image: image_path,
                    stores: vec![rule.path.clone()],
                    verity,
                    digest,
                    read_only: true,
                    attrs,
                    ..MountOptions::default()
                };
                if job.abandoned() {
                    return Err(GONE.into());
                }
                // A gc root of the store from the mount on (see gcroot).
                let root = super::gcroot::before(&rule.path, &file);
                let mut built = build_detached(&o, file).map_err(|e| e.to_string())?;
                let ids = Ids {
                    uid: caller.uid,
                    gid: caller.gids[0],
                    groups: caller.gids.clone(),
                };
                // The read-only mount serves as it is only where the
                // service attaches it itself.
                let mount = if layers.is_some() || !attach {
                    if job.abandoned() {
                        return Err(GONE.into());
                    }
                    let order = helper::Order {
                        caller: ids,
                        lower: built.mount,
                        writable: layers,
                        attrs: attrs.flags(false),
                        source: format!("{}:{}", crate::MOUNT_SOURCE, o.image.display()),
                        scratch: PathBuf::from(RECORDS),
                    };
                    helper::run_job(&self.helper, order)?
                } else {
                    built.mount
                };
                let kind = if upper { "writable" } else { "read-only" };
                let recorded = |target: Option<BorrowedFd<'_>>| {
                    root.and_then(|r| super::gcroot::record(r, mount.as_fd(), target, &peer_pidfd(conn)?))
                        .map_err(|e| format!("not recorded as a gc root of store {}: {e}", store.display()))
                };
                let Some(target) = target else {
                    // Dropped unsent otherwise: it was never attached anywhere.
                    if !job.commit() {
                        return Err(GONE.into());
                    }
                    tracing::info!(
                        "{who}: made a {kind} mount of {image} of {} for its own namespace",
                        store.display()
                    );
                    built.notices.extend(recorded(None).err());
                    return Ok((built.notices, Some(mount)));
                };
                let id = self.attach(caller, &mount, target.as_fd(), job)?;
                built.notices.extend(recorded(Some(target.as_fd())).err());
                tracing::info!("{who}: mounted {image} of {} {kind} (mount {id})", store.display());
                Ok((built.notices, None))
            }
            Request::Umount { lazy } => {
                let target = fds.next().ok_or("no mount point came with the request")?;
                if !checks::is_mount_root(&target)? {
                    return Err("not a mount point".into());
                }
                let id = unique_mount_id(target.as_fd()).map_err(|e| format!("the mount's id: {e}"))?;
                if Record::read(id).map(|r| r.uid) != Some(caller.uid) {
                    return Err("not a mount this service made for you".into());
                }
                if !lazy {
                    if let Some(why) = checks::in_use(target.as_fd())? {
                        return Err(format!(
                            "the mount is busy ({why}); close what uses it and retry, or unmount lazily"
                        ));
                    }
                }
                if !job.commit() {
                    return Err(GONE.into());
                }
                detach(&target).map_err(|e| format!("unmount: {e}"))?;
                let _ = std::fs::remove_file(Record::path(id));
                tracing::info!("{who}: unmounted mount {id}");
                Ok((Vec::new(), None))
            }
        }
    }

    /// Refuses a user who has as many live mounts from the service as the
    /// policy allows; forgets records of mounts that are gone.
    fn room_for_one_more(&self, uid: u32) -> Result<(), String> {
        let limit = self.policy.max_mounts_per_user.unwrap_or(DEFAULT_MAX_MOUNTS_PER_USER);
        let mountinfo =
            std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
        let mut live = 0;
        for e in std::fs::read_dir(RECORDS)
            .map_err(|e| format!("{RECORDS}: {e}"))?
            .flatten()
        {
            let Some(r) = e
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u64>().ok())
                .and_then(Record::read)
            else {
                continue;
            };
            if !r.alive(&mountinfo) {
                let _ = std::fs::remove_file(e.path());
            } else if r.uid == uid {
                live += 1;
            }
        }
        if live >= limit {
            return Err(format!(
                "uid {uid} has {live} mounts from this service already, the most the policy allows; unmount one first"
            ));
        }
        Ok(())
    }

    /// Attaches `mount` at `target` after checking the mount point again
    /// (nothing may have changed since the request's check), and records
    /// it as the caller's, unless the client no longer waits (then the
    /// mount is detached again). Returns its unique id.
    fn attach(&self, caller: &Caller, mount: &OwnedFd, target: BorrowedFd<'_>, job: &Job) -> Result<u64, String> {
        let _claim = self.claim(target)?;
        checks::mount_point(caller, target)?;
        let _attaching = self.begin_attach(job)?;
        rustix::mount::move_mount(
            mount,
            "",
            target,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e| format!("attaching the mount: {e}"))?;
        let id = Record::write(caller.uid, mount.as_fd()).inspect_err(|_| {
            // An unrecorded mount could never be unmounted by its user.
            let _ = detach(mount);
        })?;
        // The deadline may have passed while the kernel attached it.
        if !job.commit() {
            let _ = detach(mount);
            let _ = std::fs::remove_file(Record::path(id));
            return Err(GONE.into());
        }
        Ok(id)
    }

    /// Claims the directory `target` for one attach: a second request for
    /// it meanwhile is refused. By device and inode as cached (asking its
    /// filesystem nothing).
    fn claim(&self, target: BorrowedFd<'_>) -> Result<Claim<'_>, String> {
        let st = rustix::fs::statx(
            target,
            "",
            AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC,
            StatxFlags::INO,
        )
        .map_err(|e| format!("the mount point: {e}"))?;
        let key = (
            u64::from(st.stx_dev_major) << 32 | u64::from(st.stx_dev_minor),
            st.stx_ino,
        );
        if !self.targets.lock().unwrap_or_else(|e| e.into_inner()).insert(key) {
            return Err("another request is attaching a mount at this mount point".into());
        }
        Ok(Claim { svc: self, key })
    }

    /// Counts a mount as being attached, unless the service is shutting
    /// down or the client no longer waits.
    fn begin_attach(&self, job: &Job) -> Result<Attaching<'_>, String> {
        let mut n = self.attaching.lock().unwrap_or_else(|e| e.into_inner());
        if self.closing.load(Ordering::SeqCst) {
            return Err("the mount service is shutting down".into());
        }
        if job.abandoned() {
            return Err(GONE.into());
        }
        *n += 1;
        Ok(Attaching(self))
    }
}

type Handled = (Vec<String>, Option<OwnedFd>);

/// What the service knows of a mount it attached for a user:
/// `RECORDS/<unique mount id>` holds the user's uid, then the mount's id as
/// /proc shows it and its device, by which the service tells whether it
/// is still mounted (ids shown by /proc are reused; the pair rarely).
struct Record {
    uid: u32,
    /// `ID MAJ:MIN`, as in mountinfo's first and third fields.
    seen_as: String,
}

impl Record {
    fn path(unique_id: u64) -> PathBuf {
        Path::new(RECORDS).join(unique_id.to_string())
    }

    fn read(unique_id: u64) -> Option<Record> {
        let text = std::fs::read_to_string(Record::path(unique_id)).ok()?;
        let mut lines = text.lines();
        Some(Record {
            uid: lines.next()?.trim().parse().ok()?,
            seen_as: lines.next()?.trim().to_string(),
        })
    }

    /// Records the mount `fd` is as `uid`'s; returns its unique id.
    fn write(uid: u32, fd: BorrowedFd<'_>) -> Result<u64, String> {
        let unique = unique_mount_id(fd).map_err(|e| format!("the new mount's id: {e}"))?;
        let st = rustix::fs::statx(
            fd,
            "",
            AtFlags::EMPTY_PATH,
            StatxFlags::from_bits_retain(checks::STATX_MNT_ID),
        )
        .map_err(|e| format!("the new mount's id: {e}"))?;
        let text = format!("{uid}\n{} {}:{}\n", st.stx_mnt_id, st.stx_dev_major, st.stx_dev_minor);
        std::fs::write(Record::path(unique), text).map_err(|e| format!("cannot record the mount: {e}"))?;
        Ok(unique)
    }

    fn alive(&self, mountinfo: &str) -> bool {
        mountinfo.lines().any(|l| {
            let f: Vec<&str> = l.splitn(4, ' ').collect();
            f.len() == 4 && format!("{} {}", f[0], f[2]) == self.seen_as
        })
    }
}

/// Unmounts the mount whose root `fd` is, by that descriptor: nothing
/// anyone does to the path meanwhile can make it another mount. Detached
/// lazily, since the descriptor itself keeps the mount busy; callers ask
/// [`checks::in_use`] first when the unmount must not be lazy.
fn detach(fd: &OwnedFd) -> Result<(), Errno> {
    rustix::mount::unmount(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        rustix::mount::UnmountFlags::DETACH,
    )
}

/// Whether the client closed its end of the connection.
fn hung_up(conn: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut p = [PollFd::new(conn, PollFlags::RDHUP)];
    let now = Timespec { tv_sec: 0, tv_nsec: 0 };
    rustix::event::poll(&mut p, Some(&now)).is_ok_and(|n| n > 0)
        && p[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}

/// Whether this process has (nearly) every descriptor its limit allows
/// open, so that opening one more may have failed.
fn out_of_descriptors() -> bool {
    let Ok(limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .ok_or(())
    else {
        return false;
    };
    match std::fs::read_dir("/proc/self/fd") {
        Ok(d) => d.count() as u64 + 8 >= limit,
        // Not even one more to look with.
        Err(e) => matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)),
    }
}

/// The listening socket systemd passed, if it did (socket activation).
fn activated_socket() -> Option<OwnedFd> {
    let fd = tilefs_sys::socket::systemd_listen_fd()?;
    let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
    Some(fd)
}

fn bind(path: &Path) -> Result<OwnedFd, String> {
    let err = |what: &str, e: Errno| format!("{}: {what}: {e}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    // A socket left by an earlier run is replaced; a running service's is not.
    let fd = tilefs_sys::socket::bind_fresh(path, SocketType::SEQPACKET).map_err(|e| e.to_string())?;
    rustix::fs::chmod(path, Mode::from_raw_mode(0o666)).map_err(|e| err("chmod", e))?;
    rustix::net::listen(&fd, 128).map_err(|e| err("listen", e))?;
    Ok(fd)
}

fn reply(conn: impl AsFd, result: Result<Vec<String>, String>, fd: Option<&OwnedFd>) -> Result<(), Errno> {
    let r = match result {
        Ok(notices) => Reply {
            notices,
            ..Reply::default_ok()
        },
        Err(e) => Reply::error(e),
    };
    send_reply(conn, &r, fd)
}

fn send_reply(conn: impl AsFd, r: &Reply, fd: Option<&OwnedFd>) -> Result<(), Errno> {
    let bytes = serde_json::to_vec(r).unwrap_or_default();
    proto::send(conn, &bytes, fd.map(std::slice::from_ref).unwrap_or_default())
}

/// The caller, from the kernel: SO_PEERCRED and SO_PEERGROUPS.
fn peer(conn: &OwnedFd) -> Result<Caller, Errno> {
    let cred = rustix::net::sockopt::socket_peercred(conn)?;
    let mut gids = vec![cred.gid.as_raw()];
    if let Ok(groups) = tilefs_sys::socket::peer_groups(conn) {
        gids.extend(groups);
    }
    Ok(Caller {
        uid: cred.uid.as_raw(),
        gids,
        pid: cred.pid.as_raw_nonzero().get(),
    })
}

fn peer_pidfd(conn: &OwnedFd) -> Result<OwnedFd, String> {
    tilefs_sys::socket::peer_pidfd(conn).map_err(|e| format!("the caller's pidfd: {e}"))
}

/// Whether the caller is in the service's user namespace: read through
/// /proc while its pidfd shows it alive, so the pid names the caller.
fn in_initial_user_namespace(caller: &Caller, pidfd: &OwnedFd) -> Result<bool, String> {
    let dir = rustix::fs::open(
        format!("/proc/{}", caller.pid),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("the caller's /proc: {e}"))?;
    let theirs =
        rustix::fs::readlinkat(&dir, "ns/user", Vec::new()).map_err(|e| format!("the caller's user namespace: {e}"))?;
    let mut poll = [rustix::event::PollFd::new(pidfd, rustix::event::PollFlags::IN)];
    let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    if rustix::event::poll(&mut poll, Some(&zero)).map_err(|e| format!("the caller's pidfd: {e}"))? != 0 {
        return Err("the caller has exited".into());
    }
    let mine =
        rustix::fs::readlink("/proc/self/ns/user", Vec::new()).map_err(|e| format!("our user namespace: {e}"))?;
    Ok(theirs == mine)
}

/// The fs-verity digest of the image open as `file` (read in place: the
/// offset stays where the mount reads from), once the signature policy at
/// `policy_path` has accepted it by its pull's record.
fn signature_check(store: &Path, tag: &str, file: &std::fs::File, policy_path: &Path) -> Result<[u8; 32], String> {
    use std::os::unix::fs::FileExt;
    let len = file.metadata().map_err(|e| format!("{tag}: {e}"))?.len();
    let mut bytes = vec![0; usize::try_from(len).map_err(|_| format!("{tag}: too large"))?];
    file.read_exact_at(&mut bytes, 0)
        .map_err(|e| format!("{tag}: cannot read the image: {e}"))?;
    let d = tilefs_image::verity::digest_bytes(&bytes);
    let policy = tilefs_trust::Policy::load_roots(policy_path).map_err(|e| e.to_string())?;
    // The record of the signature check of the image, if it has one, read
    // only if root alone could have written it: a record a user could
    // write would let the user vouch for any image of theirs.
    let record_path = store
        .join(tilefs_store::store::TRUST_DIR)
        .join(format!("{}.json", hex::encode(d)));
    // Records are small; one larger than this is not ours.
    let record = tilefs_trust::rootfile::read(&record_path, 1 << 20).map_err(|e| e.to_string())?;
    tilefs_trust::evidence::check_record_bytes(record.as_deref(), store, &d, &policy)
        .map_err(|e| format!("{tag} of store {}: {e}", store.display()))?;
    Ok(d)
}

/// Opens `STORE/images/TAG`, a regular file that root alone could have
/// written, reached through no symlink (the kernel parses what it holds).
fn open_tag(store: &Path, tag: &str) -> Result<std::fs::File, String> {
    let path = store.join(tilefs_store::store::IMAGES_DIR).join(tag);
    tilefs_trust::rootfile::open(&path)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| {
            format!(
                "{}: no such tag in the store (only tagged images are served)",
                path.display()
            )
        })
}

/// A writable mount's upper and work directories: directories the caller
/// owns, two of them, on one filesystem.
fn check_layers(caller: &Caller, upper: BorrowedFd<'_>, work: BorrowedFd<'_>) -> Result<(), String> {
    let mut seen = Vec::new();
    for (fd, what) in [(upper, "upper"), (work, "work")] {
        let st = rustix::fs::fstat(fd).map_err(|e| format!("the {what} directory: {e}"))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(format!("the {what} directory is not a directory"));
        }
        if st.st_uid != caller.uid {
            return Err(format!(
                "the {what} directory is owned by uid {}, not by the caller (uid {})",
                st.st_uid, caller.uid
            ));
        }
        seen.push((st.st_dev, st.st_ino));
    }
    if seen[0] == seen[1] {
        return Err("the upper and work directories are the same".into());
    }
    if seen[0].0 != seen[1].0 {
        return Err("the upper and work directories must be on the same filesystem".into());
    }
    Ok(())
}

/// The never-reused id of the mount `fd` is in (or the mount `fd` is).
fn unique_mount_id(fd: BorrowedFd<'_>) -> Result<u64, Errno> {
    let st = rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )?;
    if st.stx_mask & STATX_MNT_ID_UNIQUE == 0 {
        return Err(Errno::NOSYS);
    }
    Ok(st.stx_mnt_id)
}

/// The socket clients use: `$TILEFS_MOUNTD_SOCKET`, else the default.
pub fn socket_path() -> PathBuf {
    std::env::var_os("TILEFS_MOUNTD_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET))
}
