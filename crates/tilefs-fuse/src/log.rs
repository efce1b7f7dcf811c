//! Where the server's messages go: stderr in the foreground, a log file when
//! one is given, syslog when running in the background without one.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

pub(crate) enum Logger {
    Stderr,
    File(Mutex<File>),
    Syslog,
}

impl Logger {
    pub(crate) fn file(path: &Path) -> std::io::Result<Logger> {
        let f = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Logger::File(Mutex::new(f)))
    }

    pub(crate) fn syslog() -> Logger {
        // The identity string must outlive every syslog call: leak it once.
        let ident: &'static CString = Box::leak(Box::new(CString::new("tilefs-fuse").unwrap()));
        // SAFETY: ident is a valid NUL-terminated string that is never freed.
        unsafe { libc::openlog(ident.as_ptr(), libc::LOG_PID | libc::LOG_NDELAY, libc::LOG_DAEMON) };
        Logger::Syslog
    }

    /// Writes one line.
    pub(crate) fn log(&self, msg: &str) {
        match self {
            Logger::Stderr => {
                let _ = writeln!(std::io::stderr().lock(), "tilefs-fuse: {msg}");
            }
            Logger::File(f) => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                let line = format!(
                    "{}.{:03} tilefs-fuse[{}]: {msg}\n",
                    now.as_secs(),
                    now.subsec_millis(),
                    std::process::id()
                );
                let _ = f.lock().unwrap().write_all(line.as_bytes());
            }
            Logger::Syslog => {
                let clean: Vec<u8> = msg.bytes().map(|b| if b == 0 { b'?' } else { b }).collect();
                let c = CString::new(clean).unwrap_or_default();
                // SAFETY: both strings are valid and NUL-terminated; the
                // format consumes exactly one string argument.
                unsafe { libc::syslog(libc::LOG_WARNING, c"%s".as_ptr(), c.as_ptr()) };
            }
        }
    }
}
