//! The server's messages: `tracing` events (at warning level: each says
//! something went other than asked). Where they go, stderr, a log file or
//! the system log ([`crate::LogTo`]), is the command's subscriber's choice.

/// A handle on the server's log, kept by the parts that write to it.
#[derive(Debug, Default)]
pub(crate) struct Logger;

impl Logger {
    /// Writes one line.
    pub(crate) fn log(&self, msg: &str) {
        tracing::warn!("{msg}");
    }
}
