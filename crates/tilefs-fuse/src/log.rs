//! Where the server's messages go: stderr in the foreground, a log file when
//! one is given, syslog when running in the background without one.

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
        tilefs_sys::syslog::open(c"tilefs-fuse");
        Logger::Syslog
    }

    /// Writes one line.
    pub(crate) fn log(&self, msg: &str) {
        match self {
            Logger::Stderr => {
                let _ = writeln!(std::io::stderr().lock(), "tilefs-fuse: {msg}");
            }
            Logger::File(f) => {
                let line = format!(
                    "{} tilefs-fuse[{}]: {msg}\n",
                    chrono::Local::now().format("%Y-%m-%d %H:%M:%S%.3f %z"),
                    std::process::id()
                );
                let _ = f.lock().unwrap().write_all(line.as_bytes());
            }
            Logger::Syslog => {
                tilefs_sys::syslog::warning(msg);
            }
        }
    }
}
