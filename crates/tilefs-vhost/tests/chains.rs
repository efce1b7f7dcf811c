//! Requests as a guest's driver puts them on a queue, well and badly made:
//! each gets its answer, or an error, never a panic; nothing is read or
//! written outside guest memory or the chain's buffers.

use tilefs_fuse_proto::abi::{self, opcode};
use tilefs_vhost::chain::{Chain, Fault};
use tilefs_vhost::fuzzing::{device, memory, one_queue};
use vm_memory::{Bytes, GuestAddress};
use zerocopy::{FromBytes, IntoBytes};

fn header(op: u32, unique: u64, body: usize) -> Vec<u8> {
    let h = abi::InHeader {
        len: (core::mem::size_of::<abi::InHeader>() + body) as u32,
        opcode: op,
        unique,
        nodeid: 1,
        uid: 0,
        gid: 0,
        pid: 0,
        total_extlen: 0,
        padding: 0,
    };
    h.as_bytes().to_vec()
}

/// A GETATTR at 0x4000 (40 + 16 bytes), reply room at 0x8000.
fn getattr(unique: u64) -> Vec<u8> {
    let mut m = header(opcode::GETATTR, unique, 16);
    m.extend_from_slice(&[0u8; 16]);
    m
}

fn answer(descs: &[(u64, u32, bool)], msg: &[u8]) -> (Chain, u32, Option<abi::OutHeader>) {
    let mem = memory(&[]);
    mem.write_slice(msg, GuestAddress(0x4000)).unwrap();
    let mut chain = Chain::default();
    chain.gather(&mem, descs.iter().map(|&(a, l, w)| (GuestAddress(a), l, w)));
    let dev = device();
    let used = dev.answer(&mem, &chain, &mut Vec::new());
    let out = chain.out.first().map(|&(a, _)| {
        let mut b = [0u8; 16];
        mem.read_slice(&mut b, a).unwrap();
        abi::OutHeader::read_from_bytes(&b).unwrap()
    });
    (chain, used, out)
}

#[test]
fn a_request_in_parts_is_answered() {
    let m = getattr(7 * 10_000 + 100);
    // The request split over two buffers, the reply over two.
    let (_, used, out) = answer(
        &[
            (0x4000, 20, false),
            (0x4014, 36, false),
            (0x8000, 50, true),
            (0x9000, 4000, true),
        ],
        &m,
    );
    let out = out.unwrap();
    assert_eq!((out.error, out.unique, out.len), (0, 70_100, 116));
    assert_eq!(used, 116);
}

#[test]
fn readable_after_writable_is_refused_with_einval() {
    let m = getattr(5);
    let (c, used, out) = answer(&[(0x4000, 40, false), (0x8000, 100, true), (0x4028, 16, false)], &m);
    assert_eq!(c.fault, Some(Fault::Order));
    assert_eq!((out.unwrap().error, used), (-libc::EINVAL, 16));
}

#[test]
fn buffers_outside_guest_memory_are_refused() {
    let m = getattr(5);
    // In the hole between the regions; past the end; wrapping around.
    for bad in [(0x12000u64, 16u32), (0x28000, 1), (0x27ff0, 0x20), (u64::MAX - 3, 16)] {
        let (c, used, out) = answer(&[(0x4000, 56, false), (bad.0, bad.1, false), (0x8000, 100, true)], &m);
        assert_eq!(c.fault, Some(Fault::OutsideMemory), "{bad:x?}");
        // The writable buffer after the bad one is not trusted either.
        assert_eq!((used, out.is_none()), (0, true), "{bad:x?}");
        let (c, used, _) = answer(&[(0x4000, 56, false), (0x8000, 100, true), (bad.0, bad.1, true)], &m);
        assert_eq!(c.fault, Some(Fault::OutsideMemory));
        assert_eq!(used, 16, "an error reply in the good buffer");
    }
}

#[test]
fn huge_lengths_are_capped() {
    let m = getattr(5);
    // A readable buffer of 4 GiB - 1 lies outside guest memory.
    let (c, _, _) = answer(&[(0x4000, u32::MAX, false), (0x8000, 100, true)], &m);
    assert_eq!(c.fault, Some(Fault::OutsideMemory));
    // Many overlapping readable buffers: more than any request.
    let descs: Vec<_> = (0..40)
        .map(|_| (0x0u64, 0x8000u32, false))
        .chain([(0x8000, 100, true)])
        .collect();
    let (c, used, _) = answer(&descs, &m);
    assert_eq!(
        (c.fault, c.msg.len() <= tilefs_vhost::chain::MAX_REQUEST),
        (Some(Fault::TooLong), true)
    );
    assert_eq!(used, 16, "an EINVAL reply");
    // Writable room past any reply is left unused.
    let descs: Vec<_> = [(0x4000u64, 56u32, false)]
        .into_iter()
        .chain((0..100).map(|_| (0x20000u64, 0x8000u32, true)))
        .collect();
    let (c, _, _) = answer(&descs, &m);
    assert!(c.capacity() <= tilefs_vhost::chain::MAX_REPLY);
}

#[test]
fn a_reply_too_large_for_its_buffers_gives_eio() {
    // Echo answers GETATTR with (unique % 10000) bytes: 5000 here.
    let m = getattr(5000);
    let (_, used, out) = answer(&[(0x4000, 56, false), (0x8000, 100, true)], &m);
    assert_eq!((out.unwrap().error, used), (-libc::EIO, 16));
    // Not even room for a header: nothing written.
    let (_, used, _) = answer(&[(0x4000, 56, false), (0x8000, 8, true)], &m);
    assert_eq!(used, 0);
}

#[test]
fn short_and_lying_headers() {
    // Shorter than a header: no answer.
    let (_, used, _) = answer(&[(0x4000, 30, false), (0x8000, 100, true)], &getattr(1));
    assert_eq!(used, 0);
    // A header claiming more than the buffers hold.
    let mut m = getattr(1);
    m[0..4].copy_from_slice(&1000u32.to_le_bytes());
    let (_, _, out) = answer(&[(0x4000, 56, false), (0x8000, 100, true)], &m);
    assert_eq!(out.unwrap().error, -libc::EINVAL);
    // A FORGET takes no reply, however malformed.
    let m = header(opcode::FORGET, 3, 0);
    let (_, used, _) = answer(&[(0x4000, 40, false), (0x8000, 100, true)], &m);
    assert_eq!(used, 0);
}

/// A small generator, for inputs of the fuzz target's shape.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_queues_never_panic() {
    let dev = device();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut answered = 0;
    for _ in 0..3000 {
        // A descriptor table, an available ring that points into it and
        // requests, with addresses near the regions' edges.
        let mut data = vec![0u8; 0x5100];
        data[0] = (rng.next() % 9) as u8;
        data[1] = rng.next() as u8;
        let base = 2;
        for i in 0..256 {
            let d = base + i * 16;
            let addr = match rng.next() % 6 {
                0 => 0x4000 + rng.next() % 0x100,
                1 => 0x20000 + rng.next() % 0x8000,
                2 => 0xfff0 + rng.next() % 0x40,
                3 => rng.next(),
                _ => 0x4000 + (rng.next() % 0x1000),
            };
            let len = match rng.next() % 5 {
                0 => rng.next() as u32,
                1 => 0,
                _ => (rng.next() % 0x2000) as u32,
            };
            let flags = (rng.next() % 8) as u16;
            let next = (rng.next() % 300) as u16;
            data[d..d + 8].copy_from_slice(&addr.to_le_bytes());
            data[d + 8..d + 12].copy_from_slice(&len.to_le_bytes());
            data[d + 12..d + 14].copy_from_slice(&flags.to_le_bytes());
            data[d + 14..d + 16].copy_from_slice(&next.to_le_bytes());
        }
        let avail = base + 0x1000;
        let idx = (rng.next() % 40) as u16;
        data[avail + 2..avail + 4].copy_from_slice(&idx.to_le_bytes());
        for i in 0..256 {
            let head = (rng.next() % 260) as u16;
            data[avail + 4 + 2 * i..avail + 6 + 2 * i].copy_from_slice(&head.to_le_bytes());
        }
        // Requests of random opcodes at 0x4000.
        for i in 0..0x1000 {
            data[base + 0x4000 + i] = rng.next() as u8;
        }
        let op = (rng.next() % 50) as u32;
        data[base + 0x4004..base + 0x4008].copy_from_slice(&op.to_le_bytes());
        answered += one_queue(&dev, &data).len();
    }
    assert!(answered > 100, "few requests reached the device: {answered}");
}

/// The fuzz target's seeds are queues a driver could have written: every
/// request on them is answered. With `TILEFS_WRITE_VIRTIO_SEEDS` naming a
/// directory, they are written there (fuzz/make-seeds.sh does).
#[test]
fn the_fuzz_seeds_are_well_formed_queues() {
    let dev = device();
    // The used lengths: a reply header (16 bytes) and what Echo answers
    // (as many bytes as the request's unique % 10000; ENOSYS to STATFS,
    // WRITE and OPEN; nothing to FORGET; EIO where the room is too small).
    let want: Vec<(&str, Vec<u32>)> = vec![
        ("getattr", vec![120]),
        ("mixed-event-idx", vec![160, 120, 8208, 0, 16, 16, 16]),
        ("indirect", vec![1016, 160]),
        ("small-queue", vec![16, 116, 216, 316, 16]),
    ];
    let seeds = tilefs_vhost::fuzzing::seeds();
    let got: Vec<(&str, Vec<u32>)> = seeds.iter().map(|(n, d)| (*n, one_queue(&dev, d))).collect();
    assert_eq!(got, want);
    if let Some(dir) = std::env::var_os("TILEFS_WRITE_VIRTIO_SEEDS") {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, data) in &seeds {
            std::fs::write(std::path::Path::new(&dir).join(name), data).unwrap();
        }
    }
}
