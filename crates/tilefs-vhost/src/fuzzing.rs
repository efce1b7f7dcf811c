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
use virtio_queue::{Queue, QueueOwnedT, QueueT};
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
    let d = Device::new(Arc::new(Echo), Arc::new(|_: &str| {}), Some("fuzz"), 1).unwrap();
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
/// bytes: the queue size and whether EVENT_IDX is on). Returns the number
/// of requests answered.
pub fn one_queue(dev: &Device<Echo>, data: &[u8]) -> usize {
    let Some((&[size, flags], rest)) = data.split_first_chunk::<2>() else {
        return 0;
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
        return 0;
    }
    let mut chain = Chain::default();
    let mut buf = Vec::new();
    let mut n = 0;
    // A guest may keep a ring full forever: a bounded number per call.
    while n < 64 {
        let Some(descs) = q.pop_descriptor_chain(&mem) else {
            break;
        };
        let head = descs.head_index();
        chain.gather(&mem, descs.map(|d| (d.addr(), d.len(), d.is_write_only())));
        let used = dev.answer(&mem, &chain, &mut buf);
        assert!(used as usize <= chain.capacity(), "wrote past the chain's buffers");
        let _ = q.add_used(&mem, head, used);
        n += 1;
    }
    // A second look at the ring, as the device's loop takes it.
    let _ = q.iter(&mem).map(|it| it.count());
    n
}
