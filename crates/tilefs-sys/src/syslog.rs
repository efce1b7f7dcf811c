//! The system log, through the C library.

use std::ffi::{CStr, CString};

/// Opens the log for this process under `ident` (kept by the C library
/// for every later message, hence `'static`).
pub fn open(ident: &'static CStr) {
    // SAFETY: ident is NUL-terminated and lives for the whole process.
    unsafe { libc::openlog(ident.as_ptr(), libc::LOG_PID | libc::LOG_NDELAY, libc::LOG_DAEMON) };
}

/// Logs one message at warning level (NUL bytes shown as `?`).
pub fn warning(msg: &str) {
    let clean: Vec<u8> = msg.bytes().map(|b| if b == 0 { b'?' } else { b }).collect();
    let c = CString::new(clean).unwrap_or_default();
    // SAFETY: both strings are NUL-terminated; the format consumes exactly
    // one string argument.
    unsafe { libc::syslog(libc::LOG_WARNING, c"%s".as_ptr(), c.as_ptr()) };
}
