//! tilefs over virtio-fs: a vhost-user-fs device backend. A VMM (QEMU's
//! `vhost-user-fs-pci`, cloud-hypervisor) connects to its socket and shares
//! the guest's memory; the guest's FUSE requests arrive on virtqueues and
//! are answered by the same [`tilefs_fuse_proto::Handler`] that answers
//! /dev/fuse and io_uring: only how the bytes travel differs ([`chain`]).
//!
//! Queue 0 is virtio-fs's high-priority queue (FORGET, INTERRUPT), served
//! on its own thread; the others carry requests, each served by a pool of
//! workers, so that a slow request (a lazy image's fetch) holds up only
//! itself. Linux's virtio-fs driver sends no INTERRUPT (and the server
//! would have nothing to stop: a request finishes or fails by its own
//! timeout); FORGETs need no ordering against requests, since the guest
//! forgets only lookups it has had the replies of. Nothing passes
//! through (backing files need a /dev/fuse): reads are copied into guest
//! memory.

pub mod chain;
#[doc(hidden)]
pub mod fuzzing;

use chain::{Chain, Fault, GuestSink};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tilefs_fuse_proto::abi::{self, opcode};
use tilefs_fuse_proto::{negotiate, Connection, Filesystem, Handler, Init, Sink};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringMutex, VringState, VringT};
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemory, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};
use zerocopy::IntoBytes;

/// Guest memory as vhost-user-backend publishes it, to the vrings.
type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;
/// Guest memory as the device reads and writes it: only a table whose
/// every region was found within its file (see [`check_regions`]).
type Checked = Arc<GuestMemoryMmap<()>>;

/// Longest virtqueue offered.
const MAX_QUEUE_SIZE: usize = 1024;

/// The virtio-fs config space: the tag the guest mounts, and how many
/// request queues there are.
const TAG_LEN: usize = 36;

/// How a device is served.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The vhost-user socket the VMM connects to (created; a stale one is
    /// replaced).
    pub socket: PathBuf,
    /// The tag, for a VMM that asks the device for it (QEMU's
    /// `vhost-user-fs-pci` takes it as its `tag` property instead).
    pub tag: Option<String>,
    /// Request queues offered (besides the high-priority one): the most
    /// the VMM may use (QEMU's `num-request-queues`).
    pub request_queues: usize,
    /// Workers per request queue: requests in flight at once on each.
    pub threads: usize,
    /// Serve one connection, then return (else the next VMM may connect).
    pub once: bool,
    /// The group the socket is shared with (mode 0660); else it is the
    /// owner's alone (0600), whatever the umask.
    pub socket_group: Option<u32>,
}

/// The device: one per VMM connection.
pub struct Device<F: Filesystem> {
    fs: Arc<F>,
    conn: Arc<Connection>,
    /// Set by INIT (again by a guest that restarts its driver).
    handler: RwLock<Option<Arc<Handler<F>>>>,
    /// Every access to guest memory goes through this table, never
    /// through the one vhost-user-backend publishes to the vrings: that
    /// one is mapped before the device may check it.
    mem: RwLock<Option<Checked>>,
    tag: Option<[u8; TAG_LEN]>,
    queues: usize,
    /// Chains refused, and replies that did not fit: counted, logged
    /// the first times only (a hostile guest must not flood the log).
    faults: AtomicU64,
}

impl<F: Filesystem> Device<F> {
    pub fn new(fs: Arc<F>, tag: Option<&str>, request_queues: usize) -> io::Result<Device<F>> {
        let tag = match tag {
            None => None,
            Some(t) if t.is_empty() || t.len() > TAG_LEN => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("the virtio-fs tag must be 1 to {TAG_LEN} bytes"),
                ))
            }
            Some(t) => {
                let mut b = [0u8; TAG_LEN];
                b[..t.len()].copy_from_slice(t.as_bytes());
                Some(b)
            }
        };
        Ok(Device {
            fs,
            conn: Connection::without_device(),
            handler: RwLock::new(None),
            mem: RwLock::new(None),
            tag,
            // One bit per queue in queues_per_thread's masks.
            queues: 1 + request_queues.clamp(1, 63),
            faults: AtomicU64::new(0),
        })
    }

    fn fault(&self, what: &str) {
        let n = self.faults.fetch_add(1, Ordering::Relaxed);
        if n < 10 {
            tracing::warn!("virtio-fs: {what}");
        } else if n == 10 {
            tracing::warn!("virtio-fs: more bad requests; not logging them any more");
        }
    }

    /// Answers the request in `chain`; returns the bytes written into its
    /// writable buffers (the used length).
    pub fn answer<M: GuestMemory>(&self, mem: &M, chain: &Chain, buf: &mut Vec<u8>) -> u32 {
        let mut sink = GuestSink::new(mem, chain, buf);
        let Some(h) = chain.header() else {
            // Not even a header: nobody to answer.
            self.fault("a request without a header");
            return 0;
        };
        let no_reply = matches!(h.opcode, opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT);
        let body = chain
            .msg
            .get(core::mem::size_of::<abi::InHeader>()..(h.len as usize).min(chain.msg.len()));
        let bad = match (chain.fault, body) {
            (Some(Fault::Order), _) => Some("a readable buffer after a writable one"),
            (Some(Fault::OutsideMemory), _) => Some("a buffer outside guest memory"),
            (Some(Fault::TooLong), _) => Some("a request too long"),
            (None, None) => Some("a request shorter than its header"),
            (None, Some(_)) if (h.len as usize) > chain.msg.len() => Some("a request longer than its buffers"),
            _ => None,
        };
        if let Some(why) = bad {
            self.fault(&format!("{why} (opcode {})", h.opcode));
            if !no_reply {
                let _ = sink.send(h.unique, -libc::EINVAL, &[]);
            }
            return sink.written;
        }
        if h.opcode == opcode::INIT {
            self.init(&h, body.unwrap_or_default(), &mut sink);
            return sink.written;
        }
        let handler = self.handler.read().unwrap().clone();
        match handler {
            Some(handler) => {
                handler.handle(&chain.msg, &mut sink);
            }
            None if no_reply => {}
            // Requests before INIT.
            None => {
                let _ = sink.send(h.unique, -libc::EIO, &[]);
            }
        }
        sink.written
    }

    pub(crate) fn init(&self, h: &abi::InHeader, body: &[u8], sink: &mut dyn Sink) {
        // Passthrough needs a /dev/fuse: never offered to the filesystem.
        let mut body = body.to_vec();
        let mut init = abi::InitIn::default();
        let take = body.len().min(core::mem::size_of::<abi::InitIn>());
        zerocopy::IntoBytes::as_mut_bytes(&mut init)[..take].copy_from_slice(&body[..take]);
        init.flags2 &= !((abi::init::PASSTHROUGH >> 32) as u32);
        body[..take].copy_from_slice(&init.as_bytes()[..take]);
        match negotiate(&*self.fs, &self.conn, &body, false) {
            Init::AskAgain { out } => {
                let _ = sink.send(h.unique, 0, &[&out]);
            }
            Init::Refused { errno, why } => {
                tracing::warn!("virtio-fs: INIT refused: {why}");
                let _ = sink.send(h.unique, -errno, &[]);
            }
            Init::Agreed { out, agreed } => {
                *self.handler.write().unwrap() = Some(Arc::new(Handler::new(self.fs.clone(), &agreed)));
                let _ = sink.send(h.unique, 0, &[&out]);
            }
        }
    }

    /// Answers every request waiting on the high-priority queue (FORGETs
    /// and INTERRUPTs: quick, so answered on the queue's own thread).
    fn drain(&self, vring: &VringMutex<Mem>, chain: &mut Chain, buf: &mut Vec<u8>) -> io::Result<()> {
        let Some(mem) = self.mem.read().unwrap().clone() else {
            return Ok(());
        };
        loop {
            // (The ring's lock is not held while the request is answered.)
            let next = pop_enabled(&mut vring.get_mut(), &mem);
            let Some(descs) = next else { break };
            let head = descs.head_index();
            chain.gather(&*mem, descs.map(|d| (d.addr(), d.len(), d.is_write_only())));
            let used = self.answer(&*mem, chain, buf);
            self.complete(&mut vring.get_mut(), &mem, head, used)?;
        }
        Ok(())
    }

    /// Puts a finished chain in the used ring (through the checked
    /// memory `mem`) and tells the guest if it asked to be told.
    fn complete(&self, v: &mut VringState<Mem>, mem: &GuestMemoryMmap<()>, head: u16, used: u32) -> io::Result<()> {
        let q = v.get_queue_mut();
        if q.add_used(mem, head, used).is_err() {
            self.fault("a used ring that cannot be written");
        }
        if q.needs_notification(mem).unwrap_or(true) {
            v.signal_used_queue()?;
        }
        Ok(())
    }
}

/// The next chain of a queue, if any; when there is none, notifications
/// are turned back on (with EVENT_IDX, the guest kicks only when asked
/// to) and the ring looked at once more. Once only: a guest whose ring
/// says there are chains that cannot be had (an available index past
/// the queue's size) must not keep a thread spinning.
pub fn pop<M>(queue: &mut Queue, mem: &M) -> Option<DescriptorChain<M>>
where
    M: Clone + std::ops::Deref,
    M::Target: GuestMemory + Sized,
{
    if !queue.ready() {
        return None;
    }
    for _ in 0..2 {
        if let Some(d) = queue.pop_descriptor_chain(mem.clone()) {
            return Some(d);
        }
        if !queue.enable_notification(&**mem).unwrap_or(false) {
            return None;
        }
    }
    None
}

/// [`pop`] from a vring the VMM has enabled.
fn pop_enabled<M>(v: &mut VringState<Mem>, mem: &M) -> Option<DescriptorChain<M>>
where
    M: Clone + std::ops::Deref,
    M::Target: GuestMemory + Sized,
{
    if !v.is_enabled() {
        return None;
    }
    pop(v.get_queue_mut(), mem)
}

/// How long a stopped queue (GET_VRING_BASE: a reset, or the VMM going
/// away) waits for its requests in flight before it is reported stopped;
/// replies of requests that finish later are dropped.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// A request queue's workers: each takes the next chain off the ring,
/// answers it and puts it in the used ring, so one slow request (a fetch
/// from a registry) holds up one worker, not the queue.
struct Pool {
    state: Mutex<PoolState>,
    /// A worker waiting for a kick.
    wake: Condvar,
    /// The last request in flight finished.
    idle: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct PoolState {
    /// The guest kicked and the ring has not been found empty since.
    kicked: bool,
    stop: bool,
    in_flight: usize,
    /// Bumped when the queue stops: a request begun before does not
    /// touch the ring the queue may have been given since.
    generation: u64,
}

impl Pool {
    fn new() -> Pool {
        Pool {
            state: Mutex::new(PoolState::default()),
            wake: Condvar::new(),
            idle: Condvar::new(),
            threads: Mutex::new(Vec::new()),
        }
    }

    fn work<F: Filesystem>(&self, dev: &Device<F>, vring: &VringMutex<Mem>) {
        let (mut chain, mut buf) = (Chain::default(), Vec::new());
        loop {
            // Chains are taken off the ring under the pool's lock, so a
            // kick cannot slip between an empty ring and going to sleep.
            let (mem, descs, generation) = {
                let mut st = self.state.lock().unwrap();
                let got = loop {
                    if st.stop {
                        return;
                    }
                    if st.kicked {
                        let mem = dev.mem.read().unwrap().clone();
                        match mem.and_then(|m| pop_enabled(&mut vring.get_mut(), &m).map(|d| (m, d))) {
                            Some(got) => break got,
                            None => st.kicked = false,
                        }
                    }
                    st = self.wake.wait(st).unwrap();
                };
                st.in_flight += 1;
                // There may be more: another worker looks.
                self.wake.notify_one();
                (got.0, got.1, st.generation)
            };
            let head = descs.head_index();
            chain.gather(&*mem, descs.map(|d| (d.addr(), d.len(), d.is_write_only())));
            let used = dev.answer(&*mem, &chain, &mut buf);
            let mut st = self.state.lock().unwrap();
            if st.generation == generation && dev.complete(&mut vring.get_mut(), &mem, head, used).is_err() {
                dev.fault("cannot notify the guest");
            }
            st.in_flight -= 1;
            if st.in_flight == 0 {
                self.idle.notify_all();
            }
        }
    }

    fn kick(&self) {
        self.state.lock().unwrap().kicked = true;
        self.wake.notify_one();
    }

    /// Waits (up to STOP_WAIT) for the requests in flight; returns how
    /// many did not finish.
    fn quiesce(&self) -> usize {
        let deadline = Instant::now() + STOP_WAIT;
        let mut st = self.state.lock().unwrap();
        while st.in_flight > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self.idle.wait_timeout(st, left).unwrap().0;
        }
        st.kicked = false;
        st.generation += 1;
        st.in_flight
    }

    /// Ends the workers once their requests are answered.
    fn end(&self) {
        self.state.lock().unwrap().stop = true;
        self.wake.notify_all();
        for t in self.threads.lock().unwrap().drain(..) {
            let _ = t.join();
        }
    }
}

/// The vhost-user backend of one connection: the device and a pool of
/// workers per request queue, started at the queue's first kick.
pub struct Backend<F: Filesystem> {
    dev: Arc<Device<F>>,
    pools: Vec<Arc<Pool>>,
    threads: usize,
    /// The exit events handed to vhost-user-backend's queue threads: see
    /// [`Backend::close_exit_events`].
    exits: Mutex<Vec<ExitEvent>>,
}

/// An exit event's consumer as vhost-user-backend took it (its number:
/// the library registers it with its epoll and never closes it), and a
/// descriptor of the same eventfd of our own, by which it is recognised.
struct ExitEvent {
    taken: std::os::fd::RawFd,
    ours: EventConsumer,
}

impl<F: Filesystem> Backend<F> {
    /// `threads`: workers per request queue.
    pub fn new(dev: Device<F>, threads: usize) -> Backend<F> {
        let pools = (0..dev.queues).map(|_| Arc::new(Pool::new())).collect();
        Backend {
            dev: Arc::new(dev),
            pools,
            threads: threads.max(1),
            exits: Mutex::new(Vec::new()),
        }
    }

    /// Closes the exit events' consumers vhost-user-backend leaves open
    /// (one per queue thread: 9 descriptors per connection with 8 request
    /// queues). Called once the connection's handler is dropped (its
    /// threads joined, their epolls closed), when nothing uses them; each
    /// number is closed only while it still names our eventfd.
    fn close_exit_events(&self) {
        for e in self.exits.lock().unwrap().drain(..) {
            tilefs_sys::fd::close_if_same_file(e.taken, &e.ours);
        }
    }

    pub fn device(&self) -> &Arc<Device<F>> {
        &self.dev
    }

    /// Ends every worker, after the request it is answering.
    pub fn shutdown(&self) {
        for p in &self.pools {
            p.end();
        }
    }

    fn start_pool(&self, q: usize, vring: &VringMutex<Mem>) -> io::Result<()> {
        let pool = &self.pools[q];
        let mut threads = pool.threads.lock().unwrap();
        while threads.len() < self.threads {
            let (dev, p, v) = (self.dev.clone(), pool.clone(), vring.clone());
            let t = std::thread::Builder::new()
                .name(format!("virtio-fs q{q}"))
                .spawn(move || p.work(&dev, &v))?;
            threads.push(t);
        }
        Ok(())
    }
}

thread_local! {
    /// The high-priority queue thread's request and reply buffers, reused.
    static BUFFERS: std::cell::RefCell<(Chain, Vec<u8>)> = std::cell::RefCell::new((Chain::default(), Vec::new()));
}

impl<F: Filesystem> VhostUserBackend for Backend<F> {
    type Bitmap = ();
    type Vring = VringMutex<Mem>;

    fn num_queues(&self) -> usize {
        self.dev.queues
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
        use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
        (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        let mut f = VhostUserProtocolFeatures::MQ;
        if self.dev.tag.is_some() {
            f |= VhostUserProtocolFeatures::CONFIG;
        }
        f
    }

    fn set_event_idx(&self, _enabled: bool) {
        // vhost-user-backend sets it on each queue, where pop() uses it.
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let mut cfg = Vec::with_capacity(TAG_LEN + 8);
        cfg.extend_from_slice(&self.dev.tag.unwrap_or([0; TAG_LEN]));
        cfg.extend_from_slice(&((self.dev.queues - 1) as u32).to_le_bytes());
        // notify_buf_size: no notification queue.
        cfg.extend_from_slice(&0u32.to_le_bytes());
        let start = (offset as usize).min(cfg.len());
        let end = start.saturating_add(size as usize).min(cfg.len());
        cfg[start..end].to_vec()
    }

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        let table = mem.memory().into_inner();
        match check_regions(&table) {
            Ok(()) => {
                *self.dev.mem.write().unwrap() = Some(table);
                Ok(())
            }
            Err(why) => {
                // No request is served until a VMM sends a table that
                // passes (the connection ends on this error).
                *self.dev.mem.write().unwrap() = None;
                tracing::warn!("virtio-fs: memory table refused: {why}; disconnecting");
                Err(io::Error::new(io::ErrorKind::InvalidInput, why))
            }
        }
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // A thread per queue: forgets never wait behind requests.
        (0..self.dev.queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        use std::os::fd::AsRawFd;
        let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()?;
        let ours = consumer.try_clone().ok()?;
        self.exits.lock().unwrap().push(ExitEvent {
            taken: consumer.as_raw_fd(),
            ours,
        });
        Some((consumer, notifier))
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // The VMM reads the ring's position when this returns: requests
        // taken off it are answered first (vhost-user's rule for
        // asynchronous backends), unless one takes longer than STOP_WAIT.
        if let Some(p) = self.pools.get(queue_index as usize) {
            let left = p.quiesce();
            if left > 0 {
                tracing::warn!(
                    "queue {queue_index} stopped with {left} requests unanswered after {}s; their replies are dropped",
                    STOP_WAIT.as_secs()
                );
            }
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        // `device_event` indexes this thread's vrings; a thread has one
        // queue (queues_per_thread), so the queue is the thread's index.
        let q = thread_id;
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Ok(());
        };
        if q == 0 {
            return BUFFERS.with(|b| {
                let (chain, buf) = &mut *b.borrow_mut();
                self.dev.drain(vring, chain, buf)
            });
        }
        if q >= self.pools.len() {
            return Ok(());
        }
        self.start_pool(q, vring)?;
        self.pools[q].kick();
        Ok(())
    }
}

/// Whether every region of `mem` lies within its file: a VMM may declare
/// a region larger than the file it sends with it, and reading guest
/// memory past the file's end would kill the server with SIGBUS. (A VMM
/// that shrinks the file later still can: only a sealed memfd, QEMU's
/// memory-backend-memfd default, rules that out.)
pub fn check_regions(mem: &GuestMemoryMmap<()>) -> Result<(), String> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    for (i, r) in mem.iter().enumerate() {
        let what = || format!("memory region {i} (guest 0x{:x}, {} bytes)", r.start_addr().0, r.len());
        let fo = r
            .file_offset()
            .ok_or_else(|| format!("{} came without a file", what()))?;
        let size = fo
            .file()
            .metadata()
            .map_err(|e| format!("{}: its file: {e}", what()))?
            .len();
        let end = fo.start().checked_add(r.len());
        if end.is_none_or(|end| end > size) {
            return Err(format!(
                "{} from offset {} is larger than its file ({size} bytes)",
                what(),
                fo.start()
            ));
        }
    }
    Ok(())
}

/// The socket VMMs connect to: created for the server's owner alone
/// (0600), or with `group` for that group too (0660), whatever the umask;
/// a stale socket there is replaced, a live one refused. It is made so
/// before it listens, so no one connects through a wider mode meanwhile.
fn listen(path: &std::path::Path, group: Option<u32>) -> io::Result<Listener> {
    use rustix::fs::{AtFlags, Mode, OFlags};
    let err = |what: &str, e: rustix::io::Errno| io::Error::other(format!("{}: {what}: {e}", path.display()));
    let fd = tilefs_sys::socket::bind_fresh(path, rustix::net::SocketType::STREAM)?;
    // By descriptor, never following a symlink: whoever may write the
    // directory cannot have the mode and group given to another file.
    let node = rustix::fs::open(path, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| err("the socket", e))?;
    let st = rustix::fs::fstat(&node).map_err(|e| err("the socket", e))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(err("the socket", rustix::io::Errno::NOTSOCK));
    }
    let mode = match group {
        Some(gid) => {
            rustix::fs::chownat(
                &node,
                "",
                None,
                Some(rustix::fs::Gid::from_raw(gid)),
                AtFlags::EMPTY_PATH,
            )
            .map_err(|e| err("chown", e))?;
            0o660
        }
        None => 0o600,
    };
    rustix::fs::chmod(
        format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&node)),
        Mode::from_raw_mode(mode),
    )
    .map_err(|e| err("chmod", e))?;
    rustix::net::listen(&fd, 16).map_err(|e| err("listen", e))?;
    Ok(Listener::from(std::os::unix::net::UnixListener::from(fd)))
}

/// Removes the socket file when serving ends, however it ends.
struct SocketFile<'a>(&'a std::path::Path);

impl Drop for SocketFile<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Serves `fs` to VMMs connecting on `opts.socket`, one at a time: a
/// guest that disconnects (or a VMM that dies) ends its connection, and
/// the next VMM may connect (unless `opts.once`).
pub fn serve<F: Filesystem>(fs: Arc<F>, opts: &Options) -> io::Result<()> {
    let mut listener = listen(&opts.socket, opts.socket_group)?;
    let _file = SocketFile(&opts.socket);
    loop {
        let device = Device::new(fs.clone(), opts.tag.as_deref(), opts.request_queues)?;
        let backend = Arc::new(Backend::new(device, opts.threads));
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
        let mut daemon = VhostUserDaemon::new("tilefs-vhost".into(), backend.clone(), mem)
            .map_err(|e| io::Error::other(format!("vhost-user: {e}")))?;
        daemon
            .start(&mut listener)
            .map_err(|e| io::Error::other(format!("vhost-user: {e}")))?;
        tracing::info!("virtio-fs: a VMM connected");
        match daemon.wait() {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => tracing::info!("virtio-fs: the VMM disconnected"),
            Err(e) => tracing::info!("virtio-fs: the connection ended: {e}"),
        }
        // Dropping the daemon ends and joins its queue threads (no more
        // kicks); then the workers finish what they were answering (a
        // write reaches the upper directory before it is answered).
        drop(daemon);
        backend.close_exit_events();
        backend.shutdown();
        if opts.once {
            fs.destroy();
            return Ok(());
        }
    }
}
