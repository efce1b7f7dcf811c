//! virtio-fs requests from a hostile guest: the input is guest memory
//! holding a split virtqueue (its size and EVENT_IDX in the first two
//! bytes), its descriptors (indirect ones too) and request buffers, all
//! arbitrary. Every request is answered (or refused) as tilefs's
//! vhost-user device answers it: never a panic, a read outside guest
//! memory, or a reply longer than the chain's writable buffers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tilefs_vhost::fuzzing::{device, one_queue, Echo};
use tilefs_vhost::Device;

static DEVICE: OnceLock<Device<Echo>> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    one_queue(DEVICE.get_or_init(device), data);
});
