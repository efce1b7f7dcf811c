//! A guest's side of the device, made from arbitrary bytes: for the fuzz
//! target `virtio_request` and the tests. The bytes are guest memory
//! (two regions with a hole between), holding a split virtqueue's
//! descriptor table, available ring and request buffers, all the
//! guest's to get wrong; every request on the queue is then answered as
//! the device answers it. Nothing may panic, nothing may be written
//! outside the chain's writable buffers, and no used length may exceed
//! them.

use crate::chain::Chain;
use crate::Device;
use std::sync::Arc;
use tilefs_fuse_proto::abi;
use tilefs_fuse_proto::{Connection, Filesystem, InitConfig, KernelInit, Op, Reply, Request};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use zerocopy::IntoBytes;

/// A filesystem that answers every request with bytes of a length the
/// request chooses (0 to 9999), or an error.
pub struct Echo;

impl Filesystem for Echo {
    fn init(&self, _kernel: &KernelInit, _conn: &Arc<Connection>) -> InitConfig {
        InitConfig::default()
    }

    fn handle(&self, req: &Request, op: Op<'_>, reply: Reply<'_>) {
        match op {
            Op::Read { .. } | Op::Lookup { .. } | Op::Getattr { .. } => {
                reply.data(&vec![0xa5; (req.unique % 10_000) as usize])
            }
            _ => reply.error(libc::ENOSYS),
        }
    }
}

/// Guest memory: 64 KiB at 0, a hole, 32 KiB at 128 KiB.
pub const REGIONS: [(u64, usize); 2] = [(0, 0x10000), (0x20000, 0x8000)];

/// The descriptor table, available and used rings' places.
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;

/// A device of [`Echo`] whose INIT was answered.
pub fn device() -> Device<Echo> {
    let d = Device::new(Arc::new(Echo), Some("fuzz"), 1).unwrap();
    let init = abi::InitIn {
        major: abi::KERNEL_VERSION,
        minor: 38,
        max_readahead: 1 << 20,
        flags: u32::MAX,
        flags2: u32::MAX,
        unused: [0; 11],
    };
    let mut sink = crate::chain::DiscardSink;
    let h = abi::InHeader {
        len: 0,
        opcode: abi::opcode::INIT,
        unique: 1,
        nodeid: 0,
        uid: 0,
        gid: 0,
        pid: 0,
        total_extlen: 0,
        padding: 0,
    };
    d.init(&h, init.as_bytes(), &mut sink);
    d
}

/// Guest memory holding `data` from address 0 (the rest zero).
pub fn memory(data: &[u8]) -> GuestMemoryMmap<()> {
    let ranges: Vec<(GuestAddress, usize)> = REGIONS.iter().map(|&(a, l)| (GuestAddress(a), l)).collect();
    let mem = GuestMemoryMmap::<()>::from_ranges(&ranges).unwrap();
    let n = data.len().min(REGIONS[0].1);
    mem.write_slice(&data[..n], GuestAddress(0)).unwrap();
    if data.len() > n {
        let m = (data.len() - n).min(REGIONS[1].1);
        mem.write_slice(&data[n..n + m], GuestAddress(REGIONS[1].0)).unwrap();
    }
    mem
}

/// Answers every request of the queue `data` describes (its first two
/// bytes: the queue size and whether EVENT_IDX is on). Returns the used
/// length of each request answered.
pub fn one_queue(dev: &Device<Echo>, data: &[u8]) -> Vec<u32> {
    let Some((&[size, flags], rest)) = data.split_first_chunk::<2>() else {
        return Vec::new();
    };
    let mem = memory(rest);
    let mut q = Queue::new(256).unwrap();
    // Sizes are powers of two; others are refused by the queue.
    q.set_size(1u16 << (size % 9));
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_event_idx(flags & 1 != 0);
    q.set_ready(true);
    if !q.is_valid(&mem) {
        return Vec::new();
    }
    let mut chain = Chain::default();
    let mut buf = Vec::new();
    let mut answered = Vec::new();
    // A guest may keep a ring full forever: a bounded number per call.
    while answered.len() < 64 {
        // As the device takes chains off its rings.
        let Some(descs) = crate::pop(&mut q, &&mem) else {
            break;
        };
        let head = descs.head_index();
        chain.gather(&mem, descs.map(|d| (d.addr(), d.len(), d.is_write_only())));
        let used = dev.answer(&mem, &chain, &mut buf);
        assert!(used as usize <= chain.capacity(), "wrote past the chain's buffers");
        let _ = q.add_used(&mem, head, used);
        answered.push(used);
    }
    answered
}

/// A guest's queue being written: the fuzz target's input, from its two
/// leading bytes on.
struct Guest {
    data: Vec<u8>,
    descs: u16,
    avail: u16,
    /// Where the next request goes.
    at: u64,
    /// Where the next reply buffer goes.
    out: u64,
    /// Indirect tables written.
    tables: u64,
}

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
/// Requests' bytes (up to the end of the first region's fuzzed part)
/// and a table of indirect descriptors.
const REQUESTS: u64 = 0x4000;
const INDIRECT: u64 = 0x3000;
/// Replies' room (not in the input: guest memory there is zeros).
const REPLIES: u64 = 0x8000;

impl Guest {
    fn new(size_log2: u8, event_idx: bool) -> Guest {
        let mut data = vec![0u8; 2 + REQUESTS as usize];
        data[0] = size_log2;
        data[1] = u8::from(event_idx);
        Guest {
            data,
            descs: 0,
            avail: 0,
            at: REQUESTS,
            out: REPLIES,
            tables: 0,
        }
    }

    fn put(&mut self, addr: u64, bytes: &[u8]) {
        let at = 2 + addr as usize;
        if self.data.len() < at + bytes.len() {
            self.data.resize(at + bytes.len(), 0);
        }
        self.data[at..at + bytes.len()].copy_from_slice(bytes);
    }

    /// A descriptor at `table[i]`.
    fn desc(&mut self, table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&addr.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        self.put(table + 16 * u64::from(i), &d);
    }

    /// Copies `msg` into guest memory; its address.
    fn request(&mut self, msg: &[u8]) -> u64 {
        let addr = self.at;
        self.put(addr, msg);
        self.at += (msg.len() as u64).next_multiple_of(64);
        addr
    }

    /// Room for a reply of `len` bytes, apart from every other.
    fn reply(&mut self, len: u32) -> u64 {
        let addr = self.out;
        self.out += u64::from(len).next_multiple_of(64);
        assert!(self.out <= REGIONS[0].1 as u64, "seed replies past the first region");
        addr
    }

    /// Offers the chain starting at descriptor `head`.
    fn offer(&mut self, head: u16) {
        let slot = AVAIL + 4 + 2 * u64::from(self.avail);
        self.put(slot, &head.to_le_bytes());
        self.avail += 1;
        self.put(AVAIL + 2, &self.avail.to_le_bytes());
    }

    /// A chain of `msg` split into `parts` readable buffers, and
    /// writable buffers of the sizes `reply`.
    fn chain(&mut self, msg: &[u8], parts: usize, reply: &[u32]) {
        let addr = self.request(msg);
        let head = self.descs;
        let piece = msg.len().div_ceil(parts.max(1));
        let mut bufs: Vec<(u64, u32, u16)> = msg
            .chunks(piece.max(1))
            .enumerate()
            .map(|(i, c)| (addr + (i * piece) as u64, c.len() as u32, 0))
            .collect();
        for &len in reply {
            bufs.push((self.reply(len), len, F_WRITE));
        }
        let n = bufs.len();
        for (i, (a, l, f)) in bufs.into_iter().enumerate() {
            let more = if i + 1 < n { F_NEXT } else { 0 };
            self.desc(DESC, self.descs, a, l, f | more, self.descs + 1);
            self.descs += 1;
        }
        self.offer(head);
    }

    /// The same through one indirect descriptor (a table at INDIRECT).
    fn indirect(&mut self, msg: &[u8], reply: u32) {
        let addr = self.request(msg);
        let table = INDIRECT + 32 * self.tables;
        self.tables += 1;
        self.desc(table, 0, addr, msg.len() as u32, F_NEXT, 1);
        let out = self.reply(reply);
        self.desc(table, 1, out, reply, F_WRITE, 0);
        let head = self.descs;
        self.desc(DESC, head, table, 32, F_INDIRECT, 0);
        self.descs += 1;
        self.offer(head);
    }
}

/// A FUSE request as the guest's driver writes it.
fn request(op: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
    let h = abi::InHeader {
        len: (core::mem::size_of::<abi::InHeader>() + body.len()) as u32,
        opcode: op,
        unique,
        nodeid,
        uid: 1000,
        gid: 1000,
        pid: 42,
        total_extlen: 0,
        padding: 0,
    };
    let mut m = h.as_bytes().to_vec();
    m.extend_from_slice(body);
    m
}

/// Well-formed queues, as Linux's virtio-fs driver fills them: requests
/// of the common opcodes (some split over several buffers, some through
/// an indirect table, replies over several writable buffers), with and
/// without EVENT_IDX. Seeds for the fuzz target (named), each answered
/// in full by [`one_queue`].
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use abi::opcode as op;
    let getattr = || request(op::GETATTR, 10_000 + 104, 1, abi::GetattrIn::default().as_bytes());
    let lookup = || request(op::LOOKUP, 20_000 + 144, 1, b"hello.txt\0");
    let read = |unique: u64, size: u32| {
        let r = abi::ReadIn {
            fh: 1,
            offset: 4096,
            size,
            ..Default::default()
        };
        request(op::READ, unique, 5, r.as_bytes())
    };
    let forget = || request(op::FORGET, 7, 5, abi::ForgetIn { nlookup: 1 }.as_bytes());
    let write = || {
        let w = abi::WriteIn {
            fh: 1,
            size: 300,
            ..Default::default()
        };
        let mut b = w.as_bytes().to_vec();
        b.extend_from_slice(&[0x5a; 300]);
        request(op::WRITE, 9, 5, &b)
    };
    let mut out = Vec::new();

    let mut g = Guest::new(8, false);
    g.chain(&getattr(), 1, &[4096]);
    out.push(("getattr", g.data));

    let mut g = Guest::new(8, true);
    g.chain(&lookup(), 1, &[256]);
    g.chain(&getattr(), 2, &[16, 104]);
    g.chain(&read(30_000 + 8192, 8192), 1, &[16, 4096, 4096]);
    g.chain(&forget(), 1, &[]);
    g.chain(&request(op::STATFS, 11, 1, &[]), 1, &[96]);
    g.chain(&write(), 3, &[24]);
    g.chain(&request(op::OPEN, 12, 5, abi::OpenIn::default().as_bytes()), 1, &[32]);
    out.push(("mixed-event-idx", g.data));

    let mut g = Guest::new(4, false);
    g.indirect(&read(40_000 + 1000, 1000), 2048);
    g.indirect(&lookup(), 256);
    out.push(("indirect", g.data));

    // A queue of 16, and a reply buffer too small for its answer.
    let mut g = Guest::new(4, true);
    for i in 0..4 {
        g.chain(&read(50_000 + 100 * i, 4096), 1, &[4096 + 16]);
    }
    g.chain(&getattr(), 1, &[40]);
    out.push(("small-queue", g.data));
    out
}
