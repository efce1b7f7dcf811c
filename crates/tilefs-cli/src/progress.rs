//! Progress on a terminal for long work: counters read from atomics by a
//! ticker thread, so the work itself pays nothing for the display.

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
        Progress::staged(label, unit, done, total, || (String::new(), false))
    }

    /// As [`Progress::bytes`], with what the work is doing now (`stage`:
    /// a phrase, and whether it waits on the network): when no bytes have
    /// come for a while in a network stage, the display says it is waiting
    /// for the server, and for how long.
    pub fn staged(
        label: &'static str,
        unit: &'static str,
        done: impl Fn() -> (u64, u64) + Send + 'static,
        total: Arc<AtomicU64>,
        stage: impl Fn() -> (String, bool) + Send + 'static,
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
        let ticker = std::thread::spawn(move || {
            let mut rate = Rate::default();
            while !stop2.load(Relaxed) {
                let (files, bytes) = done();
                let total = total.load(Relaxed);
                let (stage, network) = stage();
                let now = Instant::now();
                let (per_sec, still) = rate.update(now, bytes);
                let mut msg = String::new();
                if !stage.is_empty() {
                    msg.push_str(&stage);
                    msg.push_str(": ");
                }
                if total > 0 {
                    bar.set_length(total);
                    bar.set_position(bytes.min(total));
                    msg.push_str(&format!(
                        "{files} {unit}, {} / {}, {}/s",
                        HumanBytes(bytes),
                        HumanBytes(total),
                        HumanBytes(per_sec as u64)
                    ));
                    if per_sec > 0.0 && total > bytes {
                        msg.push_str(&format!(" ETA {:.0}s", (total - bytes) as f64 / per_sec));
                    }
                } else {
                    msg.push_str(&format!(
                        "{files} {unit}, {}, {}/s",
                        HumanBytes(bytes),
                        HumanBytes(per_sec as u64)
                    ));
                }
                if network && still >= Duration::from_secs(2) {
                    msg.push_str(&format!(" (waiting for the server, {} s)", still.as_secs()));
                }
                bar.set_message(msg);
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

/// The rate over the last few seconds (not since the start: a stage of
/// hashing, then one of sending, or a stall, shows as it is), and how long
/// the count has stood still.
#[derive(Default)]
struct Rate {
    samples: std::collections::VecDeque<(Instant, u64)>,
    last_change: Option<(Instant, u64)>,
}

impl Rate {
    const WINDOW: Duration = Duration::from_secs(5);

    fn update(&mut self, now: Instant, bytes: u64) -> (f64, Duration) {
        // A counter started again (a new stage) starts a new window.
        if self.samples.back().is_some_and(|&(_, b)| bytes < b) {
            self.samples.clear();
        }
        self.samples.push_back((now, bytes));
        while self.samples.len() > 2 && now.duration_since(self.samples[0].0) > Rate::WINDOW {
            self.samples.pop_front();
        }
        match self.last_change {
            Some((_, b)) if b == bytes => {}
            _ => self.last_change = Some((now, bytes)),
        }
        let (t0, b0) = self.samples[0];
        let secs = now.duration_since(t0).as_secs_f64();
        let rate = if secs > 0.0 {
            bytes.saturating_sub(b0) as f64 / secs
        } else {
            0.0
        };
        let still = self.last_change.map_or(Duration::ZERO, |(t, _)| now.duration_since(t));
        (rate, still)
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
