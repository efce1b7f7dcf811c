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
//! Every request and refusal is logged with the caller, escaped.

use super::checks::{self, STATX_MNT_ID_UNIQUE};
use super::helper::{self, HelperCommand, Ids, WritableLayers};
use super::policy::{Caller, Policy};
use super::proto::{self, Reply, Request};
use crate::{build_detached, MountAttrs, MountOptions, Verity};
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, StatxFlags};
use rustix::io::Errno;
use rustix::mount::MoveMountFlags;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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

/// A line of the service's log: every control character escaped, so that
/// nothing a client sent (a path with a newline, say) can forge a line.
fn log(msg: &str) {
    let escaped: String = msg
        .chars()
        .flat_map(|c| -> Box<dyn Iterator<Item = char>> {
            if c.is_control() {
                Box::new(c.escape_default())
            } else {
                Box::new(std::iter::once(c))
            }
        })
        .collect();
    eprintln!("tilefs-mountd: {escaped}");
}

/// What the service is started with.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen (unless systemd passes a socket).
    pub socket: PathBuf,
    pub policy: PathBuf,
    /// How to run the helper (`tilefs mountd --helper`).
    pub helper: HelperCommand,
}

/// The service, bound and ready to serve.
pub struct Service {
    listener: OwnedFd,
    /// The socket file this service created (removed at shutdown); none
    /// when systemd passed the socket.
    bound: Option<PathBuf>,
    policy: Policy,
    helper: HelperCommand,
    slots: Mutex<Slots>,
    /// Held from checking a mount point to attaching there, and while
    /// unmounting: two requests never race each other.
    attaching: Mutex<()>,
}

#[derive(Default)]
struct Slots {
    total: usize,
    by_uid: HashMap<u32, usize>,
}

/// A request being served; frees its slot when dropped (also when the
/// thread serving it panics).
struct Slot<'a> {
    svc: &'a Service,
    uid: u32,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut s = self.svc.slots.lock().unwrap_or_else(|e| e.into_inner());
        s.total -= 1;
        if let Some(n) = s.by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                s.by_uid.remove(&self.uid);
            }
        }
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
        log(&format!(
            "serving {} with policy {} ({} stores)",
            config.socket.display(),
            config.policy.display(),
            policy.stores.len()
        ));
        Ok(Service {
            listener,
            bound,
            policy,
            helper: config.helper.clone(),
            slots: Mutex::new(Slots::default()),
            attaching: Mutex::new(()),
        })
    }

    /// Serves clients until the process ends. A failed accept (out of
    /// descriptors or memory) is waited out, never the end of the service.
    pub fn serve(self: &Arc<Self>) -> Result<(), String> {
        let mut last_complaint: Option<Instant> = None;
        loop {
            let conn = match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC) {
                Ok(c) => c,
                Err(Errno::INTR) | Err(Errno::CONNABORTED) | Err(Errno::AGAIN) => continue,
                Err(e @ (Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM | Errno::PERM)) => {
                    if last_complaint.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        log(&format!("accept: {e}; waiting for resources"));
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
                log(&format!("cannot start a thread: {e}"));
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Ends the service: waits for a mount being attached, removes the
    /// socket file it created and logs it. The caller then exits.
    pub fn shutdown(&self, why: &str) {
        let _attaching = self.attaching.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &self.bound {
            let _ = std::fs::remove_file(p);
        }
        log(&format!("shutting down ({why})"));
    }

    /// One connection: who it is, a slot for it, its request.
    fn client(&self, conn: OwnedFd) {
        use rustix::net::sockopt;
        let _ = sockopt::set_socket_timeout(&conn, sockopt::Timeout::Recv, Some(CLIENT_TIMEOUT));
        let _ = sockopt::set_socket_timeout(&conn, sockopt::Timeout::Send, Some(CLIENT_TIMEOUT));
        let caller = match peer(&conn) {
            Ok(c) => c,
            Err(e) => return log(&format!("a client without credentials: {e}")),
        };
        let who = format!("uid {} (pid {})", caller.uid, caller.pid);
        // Users the policy does not name are answered at once, before they
        // can hold a slot.
        if !self.policy.lists(&caller) {
            log(&format!("{who}: refused: not a user the policy names"));
            let _ = reply(
                &conn,
                Err(format!("uid {} may not use this mount service", caller.uid)),
                None,
            );
            return;
        }
        let Some(_slot) = self.slot(caller.uid) else {
            log(&format!("{who}: refused: too many requests at once"));
            let _ = send_reply(&conn, &Reply::busy("the mount service is busy; try again"), None);
            return;
        };
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.request(&conn, &caller, &who)));
        if served.is_err() {
            log(&format!("{who}: internal error serving the request"));
            let _ = reply(&conn, Err("internal error in the mount service".into()), None);
        }
    }

    fn slot(&self, uid: u32) -> Option<Slot<'_>> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mine = s.by_uid.get(&uid).copied().unwrap_or(0);
        if s.total >= MAX_CLIENTS || mine >= MAX_CLIENTS_PER_USER {
            return None;
        }
        s.total += 1;
        *s.by_uid.entry(uid).or_default() += 1;
        Some(Slot { svc: self, uid })
    }

    fn request(&self, conn: &OwnedFd, caller: &Caller, who: &str) {
        let result = match proto::recv(conn) {
            Ok((bytes, fds)) => Request::parse(&bytes).and_then(|req| self.handle(caller, conn, req, fds)),
            Err(Errno::AGAIN) => return log(&format!("{who}: no request within {CLIENT_TIMEOUT:?}")),
            Err(Errno::MFILE) => {
                log(&format!(
                    "{who}: refused: no descriptors left for the ones the request carried"
                ));
                let _ = send_reply(
                    conn,
                    &Reply::busy("the mount service is busy (out of descriptors); try again"),
                    None,
                );
                return;
            }
            Err(Errno::MSGSIZE) => Err(format!("the request is larger than {} bytes", proto::MAX_MESSAGE)),
            Err(e) => return log(&format!("{who}: cannot read the request: {e}")),
        };
        let (result, back) = match result {
            Ok((notices, back)) => (Ok(notices), back),
            // Whatever failed, it may have failed for want of descriptors:
            // then the request is not refused, the service is busy.
            Err(e) if out_of_descriptors() => {
                log(&format!("{who}: busy: {e}"));
                let _ = send_reply(
                    conn,
                    &Reply::busy(format!("the mount service is busy ({e}); try again")),
                    None,
                );
                return;
            }
            Err(e) => {
                log(&format!("{who}: refused: {e}"));
                (Err(e), None)
            }
        };
        if let Err(e) = reply(conn, result, back.as_ref()) {
            log(&format!("{who}: cannot send the reply: {e}"));
        }
    }

    fn handle(&self, caller: &Caller, conn: &OwnedFd, req: Request, fds: Vec<OwnedFd>) -> Result<Handled, String> {
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
                let file = open_tag(&rule.path, &image).map_err(|e| format!("{}: {e}", image_path.display()))?;
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
                    log(&format!(
                        "{who}: made a {kind} mount of {image} of {} for its own namespace",
                        store.display()
                    ));
                    built.notices.extend(recorded(None).err());
                    return Ok((built.notices, Some(mount)));
                };
                let id = self.attach(caller, &mount, target.as_fd())?;
                built.notices.extend(recorded(Some(target.as_fd())).err());
                log(&format!(
                    "{who}: mounted {image} of {} {kind} (mount {id})",
                    store.display()
                ));
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
                let _one_at_a_time = self.attaching.lock().unwrap_or_else(|e| e.into_inner());
                if !lazy {
                    if let Some(why) = checks::in_use(target.as_fd())? {
                        return Err(format!(
                            "the mount is busy ({why}); close what uses it and retry, or unmount lazily"
                        ));
                    }
                }
                detach(&target).map_err(|e| format!("unmount: {e}"))?;
                let _ = std::fs::remove_file(Record::path(id));
                log(&format!("{who}: unmounted mount {id}"));
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
    /// it as the caller's. Returns its unique id.
    fn attach(&self, caller: &Caller, mount: &OwnedFd, target: BorrowedFd<'_>) -> Result<u64, String> {
        let _one_at_a_time = self.attaching.lock().unwrap_or_else(|e| e.into_inner());
        checks::mount_point(caller, target)?;
        rustix::mount::move_mount(
            mount,
            "",
            target,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e| format!("attaching the mount: {e}"))?;
        let recorded = Record::write(caller.uid, mount.as_fd());
        if recorded.is_err() {
            // An unrecorded mount could never be unmounted by its user.
            let _ = detach(mount);
        }
        recorded
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

/// Whether this process has (nearly) every descriptor its limit allows
/// open, so that opening one more may have failed.
fn out_of_descriptors() -> bool {
    let Ok(limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .ok_or(())
    else {
        return false;
    };
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    open + 8 >= limit
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
    // A socket left by an earlier run (never anything else).
    if std::fs::symlink_metadata(path).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type())) {
        let _ = std::fs::remove_file(path);
    }
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| err("socket", e))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| err("socket address", e))?;
    rustix::net::bind(&fd, &addr).map_err(|e| err("bind", e))?;
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

/// Opens `STORE/images/TAG` beneath the store, following no symlink,
/// without blocking, and only if it is a regular file.
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
    let policy = tilefs_trust::Policy::load(policy_path)?;
    let record = read_trust_record(store, &d).map_err(|e| format!("{tag} of store {}: {e}", store.display()))?;
    tilefs_trust::evidence::check_record_bytes(record.as_deref(), store, &d, &policy)
        .map_err(|e| format!("{tag} of store {}: {e}", store.display()))?;
    Ok(d)
}

/// The record of the signature check of image `d` (`STORE/.trust/HEX.json`),
/// if it has one, read only if root wrote it: the store, its `.trust`
/// directory and the record must be root's and writable by no one else, and
/// no symlink is followed. A record a user could write would let the user
/// vouch for any image of theirs.
fn read_trust_record(store: &Path, d: &[u8; 32]) -> Result<Option<Vec<u8>>, String> {
    use std::io::Read;
    let root_only = |fd: &OwnedFd, what: &str| -> Result<(), String> {
        let st = rustix::fs::fstat(fd).map_err(|e| format!("{what}: {e}"))?;
        if st.st_uid != 0 || st.st_mode & 0o022 != 0 {
            return Err(format!(
                "{what} is not root's alone (uid {}, mode {:04o}), so its signature check records cannot be trusted",
                st.st_uid,
                st.st_mode & 0o7777
            ));
        }
        Ok(())
    };
    let dir = rustix::fs::open(
        store,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("the store: {e}"))?;
    root_only(&dir, "the store")?;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let trust = match rustix::fs::openat2(
        &dir,
        tilefs_store::store::TRUST_DIR,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        resolve,
    ) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", tilefs_store::store::TRUST_DIR)),
    };
    root_only(&trust, tilefs_store::store::TRUST_DIR)?;
    let name = format!("{}.json", hex::encode(d));
    let fd = match rustix::fs::openat2(
        &trust,
        name.as_str(),
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
        resolve,
    ) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(e) => return Err(format!("{name}: {e}")),
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| format!("{name}: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(format!("{name}: not a regular file"));
    }
    root_only(&fd, &name)?;
    let mut raw = Vec::new();
    // Records are small; one larger than this is not ours.
    std::fs::File::from(fd)
        .take(1 << 20)
        .read_to_end(&mut raw)
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(Some(raw))
}

fn open_tag(store: &Path, tag: &str) -> Result<std::fs::File, String> {
    let dir = rustix::fs::open(
        store,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("the store: {e}"))?;
    let fd = rustix::fs::openat2(
        &dir,
        format!("{}/{tag}", tilefs_store::store::IMAGES_DIR),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| match e {
        Errno::NOENT => "no such tag in the store (only tagged images are served)".to_string(),
        e => e.to_string(),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| e.to_string())?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("not a regular file".into());
    }
    rustix::fs::fcntl_setfl(&fd, OFlags::empty()).map_err(|e| e.to_string())?;
    Ok(std::fs::File::from(fd))
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
