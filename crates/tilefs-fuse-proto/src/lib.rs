//! The FUSE protocol as tilefs speaks it: the kernel's structures
//! ([`abi`], declared once), requests parsed into [`Op`]s, [`Reply`]s that
//! answer each request exactly once, and a [`Session`] that negotiates the
//! connection and serves it, through /dev/fuse or, where the kernel
//! offers it, FUSE over io_uring with one queue per CPU.
//!
//! It knows nothing of tilefs: a [`Filesystem`] answers requests. Mounting
//! (mount(2) or fusermount3) is the caller's job; a session starts from
//! the connection's /dev/fuse descriptor. Other transports (virtqueues)
//! use the same pieces: [`negotiate`] answers INIT, a [`Handler`] answers
//! each request given its bytes and a [`Sink`] for the reply.

pub mod abi;
mod connection;
mod dev;
mod handler;
mod poll;
mod readers;
mod reply;
pub mod request;
mod session;
// io_uring entries point at buffers the kernel uses after submission:
// pushing them is unsafe by the io-uring crate's contract.
#[allow(unsafe_code)]
mod uring;

pub use connection::{BackingId, Connection};
pub use handler::{Agreed, Filesystem, Handler, InitConfig, KernelInit};
pub use poll::{worth_it as idle_poll_worth_it, WINDOW as IDLE_POLL_WINDOW};
pub use readers::may_block;
pub use reply::{DirBuf, Entry, Open, Reply, Sink, Ttl};
pub use request::{Layout, Malformed, Op, Request};
pub use session::{negotiate, Init, ServeConfig, Session, Transport};

/// Whether this kernel lets FUSE servers use io_uring now: the fuse
/// module's `enable_uring` parameter (root may change it).
pub fn uring_enabled() -> Option<bool> {
    std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .ok()
        .map(|s| s.trim() == "Y" || s.trim() == "1")
}
