//! The FUSE request parser: any opcode with any bytes, split as either
//! transport splits them, gives an operation or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_fuse_proto::request::{self, Layout, Op};

fuzz_target!(|data: &[u8]| {
    let Some((&[op, flags], body)) = data.split_first_chunk::<2>() else {
        return;
    };
    // Opcodes are small numbers; the high ones (CUSE, notify replies) too.
    let opcode = if op < 64 { u32::from(op) } else { 4096 + u32::from(op) };
    let layout = Layout { setxattr_ext: flags & 1 != 0 };
    // /dev/fuse: the fixed structure and what follows are contiguous;
    // io_uring: the header part is at most the ring entry's 128 bytes.
    let split = request::op_header_size(opcode, layout).min(body.len());
    let cut = if flags & 2 != 0 { split.min(128) } else { split };
    let (head, rest) = body.split_at(cut);
    if let Ok(Op::Write { arg, data }) = request::parse(opcode, head, rest, layout) {
        assert_eq!(data.len(), arg.size as usize);
    }
    let _ = request::forget(head);
    let _ = request::batch_forget(head, rest);
});
