//! `tilefs mountd`: kernel mounts of trusted images for users without
//! privilege. The kernel's image parsers are for trusted images only, so
//! the service mounts only images an administrator trusts (tagged images
//! of stores its policy lists, for the users and groups it names), always
//! nosuid and nodev, and only where the caller may have them.
//!
//! - [`policy`]: the policy file and its checks;
//! - [`proto`]: requests and replies on the socket;
//! - [`server`]: the service;
//! - [`checks`]: where a mount may be attached, and whether it is in use;
//! - [`gcroot`]: its mounts recorded as gc roots of their store;
//! - [`helper`]: the steps that need namespaces of their own (locked
//!   flags, writable overlays made with the caller's credentials);
//! - [`client`]: asking it.

mod checks;
pub mod client;
mod gcroot;
pub mod helper;
pub mod policy;
pub mod proto;
pub mod server;
