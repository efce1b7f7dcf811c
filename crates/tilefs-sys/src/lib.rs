//! System calls that rustix does not wrap, each behind a safe function.
//!
//! This crate holds the unsafe code of tilefs: every other crate calls
//! the kernel through rustix or through the functions here. Each unsafe
//! block says why it is sound.

// The one crate where the workspace's `unsafe_code = "deny"` is lifted.
#![allow(unsafe_code)]

pub mod creds;
pub mod fanotify;
pub mod fd;
pub mod fs;
pub mod fuse_dev;
pub mod loopdev;
pub mod mem;
pub mod ns;
pub mod process;
pub mod socket;
pub mod syslog;
pub mod users;
pub mod verity;
