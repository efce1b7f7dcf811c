//! tilefs over virtio-fs: a vhost-user-fs device backend. A VMM (QEMU's
//! `vhost-user-fs-pci`, cloud-hypervisor) connects to its socket and shares
//! the guest's memory; the guest's FUSE requests arrive on virtqueues and
//! are answered by the same [`tilefs_fuse_proto::Handler`] that answers
//! /dev/fuse and io_uring: only how the bytes travel differs ([`chain`]).
//!
//! Queue 0 is virtio-fs's high-priority queue (FORGET, INTERRUPT), the
//! others carry requests; each has a thread of its own. Nothing passes
//! through (backing files need a /dev/fuse): reads are copied into guest
//! memory.

pub mod chain;
#[doc(hidden)]
pub mod fuzzing;

use chain::{Chain, Fault, GuestSink};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use tilefs_fuse_proto::abi::{self, opcode};
use tilefs_fuse_proto::{negotiate, Connection, Filesystem, Handler, Init, Sink};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringMutex, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemory, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};
use zerocopy::IntoBytes;

type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;
type Log = Arc<dyn Fn(&str) + Send + Sync>;

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
    /// Request queues (besides the high-priority one).
    pub request_queues: usize,
    /// Serve one connection, then return (else the next VMM may connect).
    pub once: bool,
}

/// The device: one per VMM connection.
pub struct Device<F: Filesystem> {
    fs: Arc<F>,
    conn: Arc<Connection>,
    /// Set by INIT (again by a guest that restarts its driver).
    handler: RwLock<Option<Arc<Handler<F>>>>,
    mem: RwLock<Option<Mem>>,
    event_idx: AtomicBool,
    tag: Option<[u8; TAG_LEN]>,
    queues: usize,
    log: Log,
    /// Chains refused, and replies that did not fit: counted, logged
    /// the first times only (a hostile guest must not flood the log).
    faults: AtomicU64,
}

impl<F: Filesystem> Device<F> {
    pub fn new(fs: Arc<F>, log: Log, tag: Option<&str>, request_queues: usize) -> io::Result<Device<F>> {
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
            conn: Connection::without_device(log.clone()),
            handler: RwLock::new(None),
            mem: RwLock::new(None),
            event_idx: AtomicBool::new(false),
            tag,
            queues: 1 + request_queues.clamp(1, 64),
            log,
            faults: AtomicU64::new(0),
        })
    }

    fn fault(&self, what: &str) {
        let n = self.faults.fetch_add(1, Ordering::Relaxed);
        if n < 10 {
            (self.log)(&format!("virtio-fs: {what}"));
        } else if n == 10 {
            (self.log)("virtio-fs: more bad requests; not logging them any more");
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
                (self.log)(&format!("virtio-fs: INIT refused: {why}"));
                let _ = sink.send(h.unique, -errno, &[]);
            }
            Init::Agreed { out, agreed } => {
                *self.handler.write().unwrap() = Some(Arc::new(Handler::new(self.fs.clone(), &agreed)));
                let _ = sink.send(h.unique, 0, &[&out]);
            }
        }
    }

    /// Answers every request waiting on `vring`.
    fn drain(&self, vring: &VringMutex<Mem>, mem: &Mem, chain: &mut Chain, buf: &mut Vec<u8>) -> io::Result<()> {
        let mem = mem.memory();
        loop {
            let next = vring.get_mut().get_queue_mut().pop_descriptor_chain(mem.clone());
            let Some(descs) = next else { break };
            let head = descs.head_index();
            chain.gather(&*mem, descs.map(|d| (d.addr(), d.len(), d.is_write_only())));
            let used = self.answer(&*mem, chain, buf);
            if vring.add_used(head, used).is_err() {
                self.fault("a used ring that cannot be written");
            }
            if vring.needs_notification().unwrap_or(true) {
                vring.signal_used_queue()?;
            }
        }
        Ok(())
    }
}

thread_local! {
    /// Each queue thread's request and reply buffers, reused.
    static BUFFERS: std::cell::RefCell<(Chain, Vec<u8>)> = std::cell::RefCell::new((Chain::default(), Vec::new()));
}

impl<F: Filesystem> VhostUserBackend for Device<F> {
    type Bitmap = ();
    type Vring = VringMutex<Mem>;

    fn num_queues(&self) -> usize {
        self.queues
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
        if self.tag.is_some() {
            f |= VhostUserProtocolFeatures::CONFIG;
        }
        f
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let mut cfg = Vec::with_capacity(TAG_LEN + 8);
        cfg.extend_from_slice(&self.tag.unwrap_or([0; TAG_LEN]));
        cfg.extend_from_slice(&((self.queues - 1) as u32).to_le_bytes());
        // notify_buf_size: no notification queue.
        cfg.extend_from_slice(&0u32.to_le_bytes());
        let start = (offset as usize).min(cfg.len());
        let end = start.saturating_add(size as usize).min(cfg.len());
        cfg[start..end].to_vec()
    }

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        *self.mem.write().unwrap() = Some(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // A thread per queue: forgets never wait behind requests.
        (0..self.queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Ok(());
        };
        let Some(mem) = self.mem.read().unwrap().clone() else {
            return Ok(());
        };
        BUFFERS.with(|b| {
            let (chain, buf) = &mut *b.borrow_mut();
            if self.event_idx.load(Ordering::Relaxed) {
                // Until the queue stays empty with notifications on.
                loop {
                    let _ = vring.disable_notification();
                    self.drain(vring, &mem, chain, buf)?;
                    if !vring.enable_notification().unwrap_or(false) {
                        break;
                    }
                }
                Ok(())
            } else {
                self.drain(vring, &mem, chain, buf)
            }
        })
    }
}

/// Serves `fs` to VMMs connecting on `opts.socket`, one at a time: a
/// guest that disconnects (or a VMM that dies) ends its connection, and
/// the next VMM may connect (unless `opts.once`).
pub fn serve<F: Filesystem>(fs: Arc<F>, log: Log, opts: &Options) -> io::Result<()> {
    let mut listener = Listener::new(&opts.socket, true)
        .map_err(|e| io::Error::other(format!("{}: cannot listen: {e}", opts.socket.display())))?;
    loop {
        let device = Arc::new(Device::new(
            fs.clone(),
            log.clone(),
            opts.tag.as_deref(),
            opts.request_queues,
        )?);
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
        let mut daemon = VhostUserDaemon::new("tilefs-vhost".into(), device, mem)
            .map_err(|e| io::Error::other(format!("vhost-user: {e}")))?;
        daemon
            .start(&mut listener)
            .map_err(|e| io::Error::other(format!("vhost-user: {e}")))?;
        log("virtio-fs: a VMM connected");
        match daemon.wait() {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => log("virtio-fs: the VMM disconnected"),
            Err(e) => log(&format!("virtio-fs: the connection ended: {e}")),
        }
        // Dropping the daemon ends and joins its queue threads.
        drop(daemon);
        if opts.once {
            fs.destroy();
            return Ok(());
        }
    }
}
