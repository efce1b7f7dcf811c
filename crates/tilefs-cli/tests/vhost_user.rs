//! `tilefs serve --vhost-user` against VMMs that misbehave, spoken to in
//! raw vhost-user messages over its socket (the VMM's side is written here,
//! message by message, so that it can say what no real VMM would):
//!
//! - a memory table whose region is larger than the file it comes with
//!   (the server would die of SIGBUS reading guest memory past the file's
//!   end): refused, and the server serves the next VMM;
//! - 200 VMMs connecting, setting up a queue and going away: the server's
//!   descriptors stay as many as they were;
//! - who may connect: the socket is the server's owner's alone (0600)
//!   whatever the umask, or its group's too with `--socket-group`;
//! - `serve` makes `mount`'s request: its `-o` options are judged as a
//!   FUSE mount's (id maps for a writable device), and what it cannot
//!   honour is refused, saying why.

mod common;

use common::*;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// vhost-user requests (the spec's numbers).
const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const SET_VRING_ENABLE: u32 = 18;
/// Version 1 in the header's flags.
const VERSION: u32 = 1;
/// The request queue the tests use (0 is the high-priority queue).
const QUEUE: u32 = 1;

/// `tilefs serve --vhost-user`, killed when dropped, its stderr kept.
struct Server {
    child: Child,
    socket: PathBuf,
    log: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Serves a small image on `area/fs.sock`, run through `sh -c` with
    /// `umask` set first, with `extra` arguments.
    fn start(area: &Area, umask: &str, extra: &[&str]) -> Server {
        let src = area.dir("src");
        std::fs::write(src.join("hello"), b"hello\n").unwrap();
        let store = area.path("store");
        tilefs(&[
            os("build"),
            os("-q"),
            os("--store"),
            store.as_os_str(),
            os("--tag"),
            os("t"),
            src.as_os_str(),
        ]);
        let socket = area.path("fs.sock");
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("umask {umask}; exec \"$@\""))
            .arg("sh")
            .arg(tilefs_bin())
            .args([os("serve"), os("--store"), store.as_os_str(), os("t")])
            .arg("--vhost-user")
            .arg(&socket)
            .args(extra);
        let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (stderr, sink) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let end = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("the server exited ({st}): {}", log.lock().unwrap());
            }
            assert!(Instant::now() < end, "no socket");
            std::thread::sleep(Duration::from_millis(10));
        }
        Server { child, socket, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Panics (with the log) unless the server is still running.
    fn assert_running(&mut self, when: &str) {
        if let Some(st) = self.child.try_wait().unwrap() {
            panic!("the server died {when} ({st}):\n{}", self.log());
        }
    }

    /// Connects as a VMM, waiting while the server sets up its next
    /// listener (it serves one VMM at a time).
    fn vmm(&self) -> Vmm {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            match UnixStream::connect(&self.socket) {
                Ok(s) => {
                    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    return Vmm(s);
                }
                Err(e) => {
                    assert!(Instant::now() < end, "cannot connect: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// The descriptors the server has open.
    fn descriptors(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }
}

/// A VMM's end of the socket.
struct Vmm(UnixStream);

impl Vmm {
    /// Sends one request: header, payload and descriptors in one message.
    fn send(&self, request: u32, payload: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut msg = Vec::with_capacity(12 + payload.len());
        for w in [request, VERSION, payload.len() as u32] {
            msg.extend_from_slice(&w.to_le_bytes());
        }
        msg.extend_from_slice(payload);
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            control.push(SendAncillaryMessage::ScmRights(fds));
        }
        let sent = sendmsg(
            &self.0,
            &[std::io::IoSlice::new(&msg)],
            &mut control,
            SendFlags::NOSIGNAL,
        )?;
        assert_eq!(sent, msg.len());
        Ok(())
    }

    /// Asks for a u64 (the features): sends `request`, reads the reply.
    fn get_u64(&mut self, request: u32) -> std::io::Result<u64> {
        self.send(request, &[], &[])?;
        let mut reply = [0u8; 20];
        self.0.read_exact(&mut reply)?;
        assert_eq!(u32::from_le_bytes(reply[..4].try_into().unwrap()), request);
        Ok(u64::from_le_bytes(reply[12..].try_into().unwrap()))
    }

    fn set_u64(&self, request: u32, v: u64) -> std::io::Result<()> {
        self.send(request, &v.to_le_bytes(), &[])
    }

    /// What a VMM says first: owner, features, protocol features.
    fn negotiate(&mut self) -> std::io::Result<()> {
        self.send(SET_OWNER, &[], &[])?;
        let features = self.get_u64(GET_FEATURES)?;
        self.set_u64(SET_FEATURES, features)?;
        let protocol = self.get_u64(GET_PROTOCOL_FEATURES)?;
        self.set_u64(SET_PROTOCOL_FEATURES, protocol)
    }

    /// One memory region: guest address 0, `size` bytes, at VMM address
    /// `UADDR`, from the start of `file`.
    fn mem_table(&self, size: u64, file: BorrowedFd<'_>) -> std::io::Result<()> {
        let mut p = Vec::new();
        p.extend_from_slice(&1u32.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        for v in [0u64, size, UADDR, 0] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.send(SET_MEM_TABLE, &p, &[file])
    }

    /// Sets up queue `QUEUE` of 16 entries with its rings at guest
    /// addresses `rings`, `rings + 0x1000`, `rings + 0x2000`, enables it
    /// and gives it `kick` and `call`.
    fn start_queue(&self, rings: u64, kick: &OwnedFd, call: &OwnedFd) -> std::io::Result<()> {
        let state = |num: u32| [QUEUE.to_le_bytes(), num.to_le_bytes()].concat();
        self.send(SET_VRING_NUM, &state(16), &[])?;
        let mut addr = Vec::new();
        addr.extend_from_slice(&QUEUE.to_le_bytes());
        addr.extend_from_slice(&0u32.to_le_bytes());
        for a in [UADDR + rings, UADDR + rings + 0x2000, UADDR + rings + 0x1000, 0] {
            addr.extend_from_slice(&a.to_le_bytes());
        }
        self.send(SET_VRING_ADDR, &addr, &[])?;
        self.send(SET_VRING_BASE, &state(0), &[])?;
        self.send(SET_VRING_CALL, &u64::from(QUEUE).to_le_bytes(), &[call.as_fd()])?;
        self.send(SET_VRING_KICK, &u64::from(QUEUE).to_le_bytes(), &[kick.as_fd()])?;
        self.send(SET_VRING_ENABLE, &state(1), &[])
    }
}

/// Where the VMM says guest memory is in its own address space.
const UADDR: u64 = 0x7f00_0000_0000;

/// A memfd of `len` bytes: guest memory as QEMU's memory-backend-memfd has it.
fn guest_memory(len: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create("guest", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

fn eventfd() -> OwnedFd {
    rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap()
}

fn kick(fd: &OwnedFd) {
    rustix::io::write(fd, &1u64.to_ne_bytes()).unwrap();
}

/// A VMM declares one region of 1 MiB backed by a file of 4 KiB and puts
/// the queue's rings past the file's end, then kicks: reading the ring
/// there would be a SIGBUS. The table is refused, and the server answers
/// the next VMM.
#[test]
fn a_memory_region_larger_than_its_file_is_refused() {
    let area = Area::new();
    let mut server = Server::start(&area, "077", &[]);
    let mut vmm = server.vmm();
    vmm.negotiate().unwrap();
    let small = guest_memory(4096);
    let (kick_fd, call_fd) = (eventfd(), eventfd());
    // The server may hang up at once: what follows is sent if it can be.
    let sent = vmm
        .mem_table(1 << 20, small.as_fd())
        .and_then(|()| vmm.start_queue(0x10000, &kick_fd, &call_fd));
    kick(&kick_fd);
    std::thread::sleep(Duration::from_millis(500));
    server.assert_running("after a memory region larger than its file");
    // It hung up on that VMM.
    let mut byte = [0u8; 1];
    assert!(
        matches!(vmm.0.read(&mut byte), Ok(0) | Err(_)),
        "the connection stayed open (sent: {sent:?})"
    );
    let log = server.log();
    assert!(
        log.contains("memory region") && log.contains("larger than its file"),
        "{log}"
    );
    // The next VMM, with a region as large as its file, is served.
    let mut vmm = server.vmm();
    vmm.negotiate().unwrap();
    let mem = guest_memory(1 << 20);
    vmm.mem_table(1 << 20, mem.as_fd()).unwrap();
    let (kick_fd, call_fd) = (eventfd(), eventfd());
    vmm.start_queue(0x10000, &kick_fd, &call_fd).unwrap();
    kick(&kick_fd);
    // (The ring is empty: nothing to answer, nothing to fault on.)
    vmm.get_u64(GET_FEATURES).unwrap();
    server.assert_running("serving a well-formed memory table");
}

/// 200 VMMs connect, negotiate, map memory, set up and kick a queue and go
/// away: the server's descriptors are as many after as before.
#[test]
fn reconnections_leave_the_descriptor_count_flat() {
    let area = Area::new();
    let mut server = Server::start(&area, "077", &[]);
    let round = || {
        let mut vmm = server.vmm();
        vmm.negotiate().unwrap();
        let mem = guest_memory(1 << 20);
        vmm.mem_table(1 << 20, mem.as_fd()).unwrap();
        let (kick_fd, call_fd) = (eventfd(), eventfd());
        vmm.start_queue(0x10000, &kick_fd, &call_fd).unwrap();
        kick(&kick_fd);
        // A reply: everything before it has been handled.
        vmm.get_u64(GET_FEATURES).unwrap();
    };
    // Settle: the first connections set up what the server keeps.
    for _ in 0..3 {
        round();
    }
    // The server sees the hang-up and sets up its next listener.
    let settled = |server: &Server| {
        let _ = server.vmm();
        std::thread::sleep(Duration::from_millis(200));
        server.descriptors()
    };
    let before = settled(&server);
    for _ in 0..200 {
        round();
    }
    let after = settled(&server);
    server.assert_running("after 200 connections");
    eprintln!("descriptors: {before} before, {after} after 200 connections");
    assert_eq!(after, before, "descriptors leaked over 200 connections");
}

/// Under umask 000 the socket is still 0600: another user cannot connect.
/// With `--socket-group`, it is 0660 and that group's: a member connects.
#[test]
fn the_socket_is_its_owners_alone_unless_a_group_is_named() {
    let area = Area::new();
    std::fs::set_permissions(area.tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let nobody_connects = |socket: &Path| {
        let socket = socket.to_path_buf();
        std::thread::spawn(move || {
            let gid = rustix::process::Gid::from_raw(NOBODY);
            rustix::thread::set_thread_groups(&[gid]).unwrap();
            rustix::thread::set_thread_res_gid(gid, gid, gid).unwrap();
            let uid = rustix::process::Uid::from_raw(NOBODY);
            rustix::thread::set_thread_res_uid(uid, uid, uid).unwrap();
            UnixStream::connect(&socket).map(drop)
        })
        .join()
        .unwrap()
    };
    let server = Server::start(&area, "000", &[]);
    let m = std::fs::symlink_metadata(&server.socket).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o600, "the socket's mode under umask 000");
    let e = nobody_connects(&server.socket).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    drop(server);

    let getent = Command::new("getent")
        .args(["group", &NOBODY.to_string()])
        .output()
        .unwrap();
    let group = String::from_utf8_lossy(&getent.stdout)
        .split(':')
        .next()
        .unwrap()
        .to_string();
    assert!(!group.is_empty(), "no group with gid {NOBODY}");
    let shared = Area::new();
    let server = Server::start(&shared, "000", &["--socket-group", &group]);
    let m = std::fs::symlink_metadata(&server.socket).unwrap();
    assert_eq!((m.mode() & 0o7777, m.gid()), (0o660, NOBODY));
    std::fs::set_permissions(server.socket.parent().unwrap(), std::fs::Permissions::from_mode(0o755)).unwrap();
    nobody_connects(&server.socket).unwrap();
    // A group that does not exist is an error naming it.
    let out = tilefs_any(&[
        os("serve"),
        os("--vhost-user"),
        area.path("x.sock").as_os_str(),
        os("--socket-group"),
        os("no-such-group-here"),
        area.path("none").as_os_str(),
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no-such-group-here"), "{}", stderr(&out));
}

/// `serve` goes through `mount`'s request: the id maps of a writable FUSE
/// mount serve a writable device; what its server cannot honour (a second
/// store, id maps of a read-only image, mount options the guest sets) is
/// refused before a socket exists, naming the reason.
#[test]
fn serve_takes_mounts_options_and_refuses_what_it_cannot_honour() {
    let area = Area::new();
    let (upper, work) = (area.dir("upper"), area.dir("work"));
    let mut server = Server::start(
        &area,
        "077",
        &[
            "-o",
            "uidmapping=0:1000:1,gidmapping=0:1000:1",
            "--upper",
            upper.to_str().unwrap(),
            "--work",
            work.to_str().unwrap(),
        ],
    );
    server.assert_running("with id maps");
    drop(server);
    let store = area.path("store");
    for (opts, why) in [
        ("store=/nonexistent", "serves one object store"),
        ("uidmapping=0:1000:1", "apply to writable mounts"),
        ("nosuid", "mount options"),
        ("kernel", "not the kernel"),
    ] {
        let out = tilefs_any(&[
            os("serve"),
            os("--store"),
            store.as_os_str(),
            os("-o"),
            os(opts),
            os("--vhost-user"),
            area.path("x.sock").as_os_str(),
            os("t"),
        ]);
        let e = stderr(&out);
        assert!(!out.status.success(), "-o {opts}: {e}");
        assert!(e.contains(why) && e.lines().count() == 1, "-o {opts}: {e}");
        assert!(!area.path("x.sock").exists(), "-o {opts}: a socket");
    }
}
