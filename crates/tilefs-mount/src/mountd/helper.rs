//! The mount service's helper: the steps that need namespaces of their own.
//!
//! A multi-threaded process can neither enter a new user namespace nor
//! change its mount namespace, so the service runs these steps in a fresh,
//! single-threaded process of its own binary (`tilefs mountd --helper`),
//! talking to it over a socket pair on the helper's stdin:
//!
//! - **Locking a mount's flags.** A mount handed to a client in its own
//!   user namespace would let that client clear nosuid, nodev or noexec on
//!   it there. The kernel locks the flags of every mount it copies into a
//!   mount namespace owned by a new user namespace, and a clone of such a
//!   copy keeps them locked. So the helper attaches the mount in a private
//!   mount namespace, makes a new user and mount namespace (the copy), and
//!   sends back a clone of the copy.
//! - **Writable mounts.** The overlay that writes to the caller's upper
//!   directory is created with the caller's credentials, in a user
//!   namespace that maps only the caller's uid and gid (owned by root, so
//!   the caller cannot enter it), over the read-only mount the service
//!   built: every access to the image goes through the service's mount
//!   with the caller's rights, since capabilities in that namespace reach
//!   only inodes the caller owns. Its overlay attributes are `user.*`
//!   (`userxattr`: nothing the caller writes can redirect a lookup into
//!   files it may not read), and its superblock belongs to that namespace
//!   (devices never open; setuid is honoured only inside it).

use super::proto::{self, Reply};
use crate::fsctx::FsContext;
use crate::MountError;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, StatxFlags};
use rustix::mount::{MountAttrFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags};
use rustix::thread::UnshareFlags;
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// statx's STATX_MNT_ID_UNIQUE (Linux 6.8).
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;
/// The helper has this long for a job; then it is killed.
const HELPER_TIMEOUT: Duration = Duration::from_secs(60);

/// How the service starts its helper: a program and its arguments.
#[derive(Debug, Clone)]
pub struct HelperCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

/// The caller's ids, as the service learnt them from the kernel.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// One job for the helper. The descriptors that come with it: the
/// service's read-only mount, then for a writable mount the caller's upper
/// and work directories and a pidfd of the caller.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Job {
    caller: Ids,
    writable: bool,
    /// The writable overlay's mount attributes (MOUNT_ATTR_* bits).
    attrs: u64,
    /// The writable overlay's source, as mountinfo will show it.
    source: String,
    /// A directory that exists in the service's mount namespace, where the
    /// helper mounts its scratch tmpfs in a private copy of it.
    scratch: PathBuf,
}

/// Messages from the helper besides its final reply.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "lowercase", deny_unknown_fields)]
enum Step {
    /// The helper is in its new user namespace: write its id maps.
    Map,
    /// Done (with the mount, or why not).
    Done(Reply),
}

/// What a writable mount needs besides the read-only one.
pub struct WritableLayers {
    pub upper: OwnedFd,
    pub work: OwnedFd,
    /// The caller, to reach its mount namespace when the directories are in it.
    pub caller_pidfd: OwnedFd,
}

/// A mount for the helper to make.
pub struct Order {
    pub caller: Ids,
    /// The read-only mount the service built.
    pub lower: OwnedFd,
    /// For a writable mount: the caller's directories.
    pub writable: Option<WritableLayers>,
    /// The writable overlay's mount attributes.
    pub attrs: MountAttrFlags,
    /// The writable overlay's source, as mountinfo will show it.
    pub source: String,
    /// A directory of the service's mount namespace that the helper may
    /// mount its scratch space over, in its private copy of it.
    pub scratch: PathBuf,
}

/// Has the helper make the mount to hand out: the read-only mount with its
/// flags locked, or the writable overlay on it.
pub fn run_job(cmd: &HelperCommand, order: Order) -> Result<OwnedFd, String> {
    let (ours, theirs) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| format!("helper socket: {e}"))?;
    let t = Some(HELPER_TIMEOUT);
    let _ = rustix::net::sockopt::set_socket_timeout(&ours, rustix::net::sockopt::Timeout::Recv, t);
    let child = Command::new(&cmd.program)
        .args(&cmd.args)
        .env_clear()
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start the helper {}: {e}", cmd.program.display()))?;
    let mut child = Reaped(child);
    let pid = child.0.id();
    let ids = (order.caller.uid, order.caller.gid);
    let job = Job {
        caller: order.caller,
        writable: order.writable.is_some(),
        attrs: order.attrs.bits() as u64,
        source: order.source,
        scratch: order.scratch,
    };
    let mut fds = vec![order.lower];
    if let Some(w) = order.writable {
        fds.extend([w.upper, w.work, w.caller_pidfd]);
    }
    let bytes = serde_json::to_vec(&job).map_err(|e| e.to_string())?;
    proto::send(&ours, &bytes, &fds).map_err(|e| format!("sending the helper its job: {e}"))?;
    drop(fds);
    loop {
        let (bytes, mut back) = proto::recv(&ours).map_err(|e| match e {
            rustix::io::Errno::AGAIN => format!("the helper did not finish within {HELPER_TIMEOUT:?}"),
            e => format!("the helper's answer: {e}"),
        })?;
        if bytes.is_empty() {
            return Err(format!("the helper exited: {}", child.status()));
        }
        match serde_json::from_slice::<Step>(&bytes).map_err(|e| format!("the helper's answer: {e}"))? {
            Step::Map => {
                write_id_maps(pid, ids.0, ids.1)?;
                proto::send(&ours, b"{}", &[]).map_err(|e| format!("answering the helper: {e}"))?;
            }
            Step::Done(r) if r.ok => {
                return back.pop().ok_or_else(|| "the helper sent no mount".to_string());
            }
            Step::Done(r) => return Err(r.error.unwrap_or_else(|| "the helper failed".into())),
        }
    }
}

/// The helper child, killed and reaped when its job is over.
struct Reaped(Child);

impl Reaped {
    fn status(&mut self) -> String {
        match self.0.wait() {
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        }
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Maps uid and gid 0 of the helper's new user namespace to the caller's,
/// and nothing else: written by the service, which may map any id.
fn write_id_maps(pid: u32, uid: u32, gid: u32) -> Result<(), String> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    for (file, text) in [
        ("uid_map", format!("0 {uid} 1\n")),
        ("setgroups", "deny\n".to_string()),
        ("gid_map", format!("0 {gid} 1\n")),
    ] {
        std::fs::write(proc.join(file), text).map_err(|e| format!("the helper's {file}: {e}"))?;
    }
    Ok(())
}

/// The helper process: reads one job from `ctl`, answers, exits.
pub fn main(ctl: OwnedFd) -> i32 {
    // Gone with the service, whatever happens to it.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let (reply, mount) = match helper(&ctl) {
        Ok(m) => (Reply::default_ok(), Some(m)),
        Err(e) => (Reply::error(e), None),
    };
    let bytes = serde_json::to_vec(&Step::Done(reply)).unwrap_or_default();
    let sent = proto::send(&ctl, &bytes, mount.as_slice());
    i32::from(mount.is_none() || sent.is_err())
}

fn helper(ctl: &OwnedFd) -> Result<OwnedFd, String> {
    let (bytes, fds) = proto::recv_at_most(ctl, 4).map_err(|e| format!("reading the job: {e}"))?;
    let job: Job = serde_json::from_slice(&bytes).map_err(|e| format!("malformed job: {e}"))?;
    let mut fds = fds.into_iter();
    let lower = fds.next().ok_or("no mount came with the job")?;
    // The directories are reached while still in the service's namespaces.
    let layers = if job.writable {
        let (upper, work, pidfd) = match (fds.next(), fds.next(), fds.next()) {
            (Some(u), Some(w), Some(p)) => (u, w, p),
            _ => return Err("no upper and work directories came with the job".into()),
        };
        Some(Layers::clone(upper, work, &pidfd)?)
    } else {
        None
    };

    let ns = |flags, what: &str| tilefs_sys::ns::unshare(flags).map_err(|e| format!("{what}: {e}"));
    ns(UnshareFlags::NEWNS, "a mount namespace of its own")?;
    // Nothing mounted here may propagate back to the service's namespace.
    rustix::mount::mount_change("/", MountPropagationFlags::PRIVATE | MountPropagationFlags::REC)
        .map_err(|e| format!("making its mounts private: {e}"))?;
    let scratch = Scratch::mount(&job.scratch)?;
    let top = match layers {
        None => {
            scratch.attach(&lower, "top")?;
            "top"
        }
        Some(layers) => {
            scratch.attach(&lower, "lower")?;
            scratch.attach(&layers.clone, "layers")?;
            become_caller(ctl, &job.caller)?;
            // A mount namespace owned by the caller's user namespace, where
            // that namespace may create the overlay.
            ns(UnshareFlags::NEWNS, "a mount namespace for the caller")?;
            let (upper, work) = layers.reopen(&scratch.path("layers"))?;
            let ovl = writable_overlay(&scratch.path("lower"), &upper, &work, &job)?;
            scratch.attach(&ovl, "top")?;
            "top"
        }
    };
    // The copy made now has every flag locked; hand out a clone of it.
    ns(UnshareFlags::NEWUSER | UnshareFlags::NEWNS, "locking the mount's flags")?;
    rustix::mount::open_tree(
        rustix::fs::CWD,
        scratch.path(top),
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .map_err(|e| format!("cloning the locked mount: {e}"))
}

/// A tmpfs of the helper's own, mounted (in its private mount namespace)
/// over an existing directory, holding the mount points it needs.
struct Scratch(PathBuf);

impl Scratch {
    fn mount(at: &Path) -> Result<Scratch, String> {
        let fs = FsContext::open("tmpfs").map_err(|e| e.to_string())?;
        fs.set_string("mode", "0755").map_err(|e| e.to_string())?;
        fs.create().map_err(|e| e.to_string())?;
        let m = fs.fsmount(MountAttrFlags::empty()).map_err(|e| e.to_string())?;
        for name in ["lower", "layers", "top"] {
            rustix::fs::mkdirat(&m, name, Mode::from_raw_mode(0o755)).map_err(|e| format!("scratch {name}: {e}"))?;
        }
        rustix::mount::move_mount(&m, "", rustix::fs::CWD, at, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
            .map_err(|e| format!("mounting scratch space at {}: {e}", at.display()))?;
        Ok(Scratch(at.to_path_buf()))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn attach(&self, mount: &OwnedFd, name: &str) -> Result<(), String> {
        rustix::mount::move_mount(
            mount,
            "",
            rustix::fs::CWD,
            self.path(name),
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|e| format!("attaching the {name} mount: {e}"))
    }
}

/// Takes on the caller's groups, then enters a new user namespace in which
/// the service maps uid and gid 0 to the caller's, and becomes that 0.
fn become_caller(ctl: &OwnedFd, ids: &Ids) -> Result<(), String> {
    let groups: Vec<_> = ids.groups.iter().map(|&g| rustix::process::Gid::from_raw(g)).collect();
    rustix::thread::set_thread_groups(&groups).map_err(|e| format!("taking the caller's groups: {e}"))?;
    tilefs_sys::ns::unshare(UnshareFlags::NEWUSER).map_err(|e| format!("a user namespace for the caller: {e}"))?;
    let ask = serde_json::to_vec(&Step::Map).map_err(|e| e.to_string())?;
    proto::send(ctl, &ask, &[]).map_err(|e| format!("asking for id maps: {e}"))?;
    proto::recv(ctl).map_err(|e| format!("waiting for id maps: {e}"))?;
    let root_gid = rustix::process::Gid::from_raw(0);
    let root_uid = rustix::process::Uid::from_raw(0);
    rustix::thread::set_thread_res_gid(root_gid, root_gid, root_gid).map_err(|e| format!("setresgid: {e}"))?;
    rustix::thread::set_thread_res_uid(root_uid, root_uid, root_uid).map_err(|e| format!("setresuid: {e}"))?;
    Ok(())
}

/// The overlay on `lower` writing to `upper` (created in the caller's user
/// namespace: see the module's comment).
fn writable_overlay(lower: &Path, upper: &OwnedFd, work: &OwnedFd, job: &Job) -> Result<OwnedFd, String> {
    let e = |e: MountError| e.to_string();
    let ovl = FsContext::open("overlay").map_err(e)?;
    ovl.set_string("source", &job.source).map_err(e)?;
    ovl.set_string("lowerdir+", lower).map_err(e)?;
    ovl.set_fd("upperdir", upper, "the upper directory").map_err(e)?;
    ovl.set_fd("workdir", work, "the work directory").map_err(e)?;
    ovl.set_flag("userxattr").map_err(e)?;
    // Directory inode numbers that stay put across evictions (tar and find
    // take a changed one for a rename), as for the service's own overlays.
    ovl.set_string("xino", "on").map_err(e)?;
    ovl.create().map_err(|err| match err.errno() {
        Some(rustix::io::Errno::OVERFLOW) => {
            "the upper or work directory belongs to an id other than the caller's".to_string()
        }
        _ => err.to_string(),
    })?;
    let attrs = MountAttrFlags::from_bits_retain(job.attrs as _);
    ovl.fsmount(attrs).map_err(e)
}

/// The caller's upper and work directories, as one clone of the directory
/// that holds both (overlayfs wants them on one mount), and where each is
/// inside it.
struct Layers {
    clone: OwnedFd,
    upper: (PathBuf, (u64, u64)),
    work: (PathBuf, (u64, u64)),
}

impl Layers {
    fn clone(upper: OwnedFd, work: OwnedFd, caller: &OwnedFd) -> Result<Layers, String> {
        let (su, sw) = (identity(&upper, "upper")?, identity(&work, "work")?);
        if su.mnt != sw.mnt {
            return Err("the upper and work directories must be on the same mount".into());
        }
        let (pu, pw) = (fd_path(&upper)?, fd_path(&work)?);
        let (cu, cw): (Vec<_>, Vec<_>) = (pu.components().collect(), pw.components().collect());
        let common = cu.iter().zip(&cw).take_while(|(a, b)| a == b).count();
        if common == cu.len() || common == cw.len() {
            return Err("the upper and work directories must not be inside one another".into());
        }
        let up_anc = walk_up(&upper, cu.len() - common, su.mnt)?;
        let wk_anc = walk_up(&work, cw.len() - common, su.mnt)?;
        if identity(&up_anc, "upper")?.file != identity(&wk_anc, "work")?.file {
            return Err("the upper or work directory moved while it was being mounted".into());
        }
        let rel = |c: &[Component]| c.iter().collect::<PathBuf>();
        let clone = clone_tree(&up_anc, caller)?;
        Ok(Layers {
            clone,
            upper: (rel(&cu[common..]), su.file),
            work: (rel(&cw[common..]), sw.file),
        })
    }

    /// The upper and work directories inside the clone attached at `at`,
    /// checked to be the very directories the caller sent.
    fn reopen(&self, at: &Path) -> Result<(OwnedFd, OwnedFd), String> {
        let base = rustix::fs::open(at, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| format!("the layers: {e}"))?;
        let open = |(rel, file): &(PathBuf, (u64, u64)), what: &str| {
            let fd = rustix::fs::openat2(
                &base,
                rel,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV | ResolveFlags::NO_MAGICLINKS,
            )
            .map_err(|e| format!("the {what} directory moved while it was being mounted ({e})"))?;
            if identity(&fd, what)?.file != *file {
                return Err(format!("the {what} directory moved while it was being mounted"));
            }
            Ok(fd)
        };
        Ok((open(&self.upper, "upper")?, open(&self.work, "work")?))
    }
}

struct Identity {
    /// Device and inode.
    file: (u64, u64),
    /// Unique mount id.
    mnt: u64,
}

fn identity(fd: &OwnedFd, what: &str) -> Result<Identity, String> {
    let st = rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::INO | StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )
    .map_err(|e| format!("the {what} directory: {e}"))?;
    let dev = rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor);
    Ok(Identity {
        file: (dev, st.stx_ino),
        mnt: st.stx_mnt_id,
    })
}

/// Where `fd` is, as the kernel names it.
fn fd_path(fd: &OwnedFd) -> Result<PathBuf, String> {
    use std::os::fd::AsRawFd;
    let link = rustix::fs::readlink(format!("/proc/self/fd/{}", fd.as_raw_fd()), Vec::new())
        .map_err(|e| format!("a directory's name: {e}"))?;
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(link.as_bytes())))
}

/// The directory `levels` above `fd`, on the same mount.
fn walk_up(fd: &OwnedFd, levels: usize, mnt: u64) -> Result<OwnedFd, String> {
    let mut cur = rustix::fs::openat(
        fd,
        ".",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("a layer directory: {e}"))?;
    for _ in 0..levels {
        cur = rustix::fs::openat(
            &cur,
            "..",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| format!("a layer directory's parent: {e}"))?;
        if identity(&cur, "layer")?.mnt != mnt {
            return Err("the upper and work directories must be inside one mount".into());
        }
    }
    Ok(cur)
}

/// A detached clone of the directory `dir`: made here when it is in this
/// mount namespace, else in the caller's (whose directories they are).
fn clone_tree(dir: &OwnedFd, caller: &OwnedFd) -> Result<OwnedFd, String> {
    let clone = |d: BorrowedFd<'_>| {
        rustix::mount::open_tree(
            d,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_EMPTY_PATH,
        )
    };
    match clone(dir.as_fd()) {
        Ok(c) => return Ok(c),
        Err(rustix::io::Errno::INVAL) => {}
        Err(e) => return Err(format!("cloning the layers' directory: {e}")),
    }
    let own = rustix::fs::open("/proc/self/ns/mnt", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| format!("this mount namespace: {e}"))?;
    rustix::thread::move_into_thread_name_spaces(caller.as_fd(), rustix::thread::ThreadNameSpaceType::MOUNT)
        .map_err(|e| format!("entering the caller's mount namespace: {e}"))?;
    let c = clone(dir.as_fd());
    rustix::thread::move_into_link_name_space(own.as_fd(), Some(rustix::thread::LinkNameSpaceType::Mount))
        .map_err(|e| format!("leaving the caller's mount namespace: {e}"))?;
    c.map_err(|e| format!("cloning the layers' directory in the caller's mount namespace: {e}"))
}
