//! Progress on a terminal for long work: counters read from atomics by a
//! ticker thread, so the work itself pays nothing for the display.

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A progress display that updates itself until dropped.
pub struct Progress {
    stop: Arc<AtomicBool>,
    ticker: Option<JoinHandle<()>>,
}

/// Shown only on a terminal and unless `quiet`.
pub fn enabled(quiet: bool) -> bool {
    !quiet && std::io::stderr().is_terminal()
}

impl Progress {
    /// Shows `label`, items (`unit`: "files", "entries") and bytes done
    /// (from `done`), and, once `total` is known (non-zero), a bar with rate
    /// and ETA.
    pub fn bytes(
        label: &'static str,
        unit: &'static str,
        done: impl Fn() -> (u64, u64) + Send + 'static,
        total: Arc<AtomicU64>,
    ) -> Progress {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(8));
        bar.set_style(
            ProgressStyle::with_template("{prefix} {wide_bar} {msg}")
                .unwrap()
                .progress_chars("=> "),
        );
        bar.set_prefix(label);
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let start = std::time::Instant::now();
        let ticker = std::thread::spawn(move || {
            while !stop2.load(Relaxed) {
                let (files, bytes) = done();
                let total = total.load(Relaxed);
                let secs = start.elapsed().as_secs_f64().max(0.001);
                let rate = bytes as f64 / secs;
                if total > 0 {
                    bar.set_length(total);
                    bar.set_position(bytes.min(total));
                    let eta = if rate > 0.0 && total > bytes {
                        format!("ETA {:.0}s", (total - bytes) as f64 / rate)
                    } else {
                        String::new()
                    };
                    bar.set_message(format!(
                        "{files} {unit}, {} / {}, {}/s {eta}",
                        HumanBytes(bytes),
                        HumanBytes(total),
                        HumanBytes(rate as u64)
                    ));
                } else {
                    bar.set_message(format!(
                        "{files} {unit}, {}, {}/s",
                        HumanBytes(bytes),
                        HumanBytes(rate as u64)
                    ));
                }
                std::thread::sleep(Duration::from_millis(120));
            }
            bar.finish_and_clear();
        });
        Progress {
            stop,
            ticker: Some(ticker),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

/// Sums the sizes of regular files under `root` in the background, so a
/// progress bar can show an ETA; metadata only, and it warms the caches the
/// real walk uses next.
pub fn measure_in_background(root: std::path::PathBuf, min_size: u64) -> Arc<AtomicU64> {
    let total = Arc::new(AtomicU64::new(0));
    let out = total.clone();
    std::thread::spawn(move || {
        let mut sum = 0u64;
        let mut stack = vec![root];
        while let Some(dir) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&dir) else { continue };
            for e in rd.flatten() {
                let Ok(ft) = e.file_type() else { continue };
                if ft.is_dir() {
                    stack.push(e.path());
                } else if ft.is_file() {
                    if let Ok(m) = e.metadata() {
                        if m.len() > min_size {
                            sum += m.len();
                        }
                    }
                }
            }
        }
        out.store(sum.max(1), Relaxed);
    });
    total
}
