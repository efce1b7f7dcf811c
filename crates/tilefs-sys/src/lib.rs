//! System calls that rustix does not wrap, each behind a safe function.
//!
//! This crate holds the unsafe code of tilefs: every other crate calls
//! the kernel through rustix or through the functions here. Each unsafe
//! block says why it is sound.

pub mod creds;
pub mod ns;
pub mod socket;
pub mod users;
