//! Where the libraries' `tracing` events go: one line each, in the CLI's
//! own style (`tilefs: message`), on stderr unless a daemon sends them to
//! its log file or the system log. A log file's lines carry the time and
//! the process id (`2026-01-02 03:04:05.678 +0000 tilefs-fuse[42]: ...`);
//! a terminal's do not.
//!
//! `TILEFS_LOG` chooses what is shown, in `tracing`'s filter syntax
//! (`debug`, `warn`, `tilefs_mount=debug,info`...); the default is `info`.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The variable that sets the level (and per-crate levels).
const LEVEL_VAR: &str = "TILEFS_LOG";

/// Where lines go.
enum Sink {
    /// stderr; with the time when it is a regular file (a daemon's log).
    Stderr {
        stamped: bool,
    },
    File(File),
    /// The system log (it stamps lines itself).
    Syslog,
}

struct Out {
    /// What each line starts with: the program's name, as its own
    /// messages say it (`tilefs`, `tilefs-mountd`...).
    name: &'static str,
    sink: Sink,
}

static OUT: Mutex<Out> = Mutex::new(Out {
    name: "tilefs",
    sink: Sink::Stderr { stamped: false },
});

fn out() -> std::sync::MutexGuard<'static, Out> {
    // A thread that panicked while writing a line left nothing half-done
    // that matters: logging goes on.
    OUT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Installs the subscriber: lines named `name`, on stderr. Called once, at
/// start.
pub fn init(name: &'static str) {
    let filter = EnvFilter::builder()
        .with_default_directive(tracing::level_filters::LevelFilter::INFO.into())
        .with_env_var(LEVEL_VAR)
        .from_env_lossy();
    out().name = name;
    out().sink = Sink::Stderr {
        stamped: stderr_is_file(),
    };
    // Only fails when a subscriber is already set: that one stays.
    let _ = tracing_subscriber::registry()
        .with(Lines.with_filter(filter))
        .try_init();
}

/// Names the lines from now on (a command that runs as a daemon of its
/// own name).
pub fn set_name(name: &'static str) {
    out().name = name;
}

/// Where a server's lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTo {
    Stderr,
    Syslog,
    /// Appended to this file.
    File(PathBuf),
}

/// Sends a FUSE or vhost-user server's lines where `to` says, named
/// `tilefs-fuse` as the server's own.
pub fn to_server_log(to: &LogTo) -> anyhow::Result<()> {
    let sink = match to {
        LogTo::Stderr => Sink::Stderr {
            stamped: stderr_is_file(),
        },
        LogTo::File(p) => Sink::File(
            File::options()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
        ),
        LogTo::Syslog => {
            tilefs_sys::syslog::open(c"tilefs-fuse");
            Sink::Syslog
        }
    };
    let mut out = out();
    out.name = "tilefs-fuse";
    out.sink = sink;
    Ok(())
}

/// Whether stderr is a regular file: then its lines are a log's.
fn stderr_is_file() -> bool {
    rustix::fs::fstat(rustix::stdio::stderr())
        .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile)
}

/// The layer that writes each event as one line.
struct Lines;

impl<S: Subscriber> Layer<S> for Lines {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut text = Text::default();
        event.record(&mut text);
        let msg = match *event.metadata().level() {
            Level::DEBUG => format!("debug: {}", text.0),
            Level::TRACE => format!("trace: {}", text.0),
            _ => text.0,
        };
        // Nothing an event carries (a file name with a newline, a
        // client's string) can start a line of its own.
        let msg = crate::one_line(&msg);
        let mut out = out();
        let name = out.name;
        match &mut out.sink {
            Sink::Stderr { stamped: false } => {
                let _ = writeln!(std::io::stderr().lock(), "{name}: {msg}");
            }
            Sink::Stderr { stamped: true } => {
                let _ = std::io::stderr().lock().write_all(stamped(name, &msg).as_bytes());
            }
            Sink::File(f) => {
                let _ = f.write_all(stamped(name, &msg).as_bytes());
            }
            Sink::Syslog => tilefs_sys::syslog::warning(&msg),
        }
    }
}

/// A log file's line: the local time, the program and its pid.
fn stamped(name: &str, msg: &str) -> String {
    format!(
        "{} {name}[{}]: {msg}\n",
        chrono::Local::now().format("%Y-%m-%d %H:%M:%S%.3f %z"),
        std::process::id()
    )
}

/// An event's message, then its other fields as ` key=value`.
#[derive(Default)]
struct Text(String);

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.insert_str(0, value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0.insert_str(0, &format!("{value:?}"));
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}
