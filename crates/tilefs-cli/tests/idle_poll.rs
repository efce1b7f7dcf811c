//! `--idle-poll`: while a FUSE mount serves requests its server holds a
//! 0 µs CPU latency request (idle CPUs poll instead of halting), and it lets
//! go once the requests stop, so an idle mount never keeps CPUs spinning.
//!
//! What the kernel enforces is read back from /dev/cpu_dma_latency (the
//! strictest request of all processes). A test binary of its own: another
//! test's mount, serving requests meanwhile, would hold one too.

mod common;

use common::*;
use std::fs;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEVICE: &str = "/dev/cpu_dma_latency";

/// The CPU latency limit in force, in µs.
fn latency_limit() -> i32 {
    let mut b = [0u8; 4];
    fs::File::open(DEVICE).unwrap().read_exact(&mut b).unwrap();
    i32::from_ne_bytes(b)
}

fn cannot_test() -> Option<String> {
    if !is_root() {
        return Some("not running as root (the latency request needs it)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse".into());
    }
    if !Path::new(DEVICE).exists() {
        return Some(format!("no {DEVICE} (kernel without CPU latency QoS)"));
    }
    if latency_limit() == 0 {
        return Some("another process holds a 0 µs CPU latency request already".into());
    }
    None
}

/// Opens and closes `file` (each open is a request: passthrough needs the
/// server at every open) until dropped.
struct Load(Arc<AtomicBool>, Option<std::thread::JoinHandle<()>>);

fn load(file: &Path) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let (s, f) = (stop.clone(), file.to_path_buf());
    Load(
        stop,
        Some(std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                drop(fs::File::open(&f).unwrap());
            }
        })),
    )
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        if let Some(t) = self.1.take() {
            let _ = t.join();
        }
    }
}

/// Waits up to 2 s for the limit to become `want`.
fn limit_becomes(want: i32) -> bool {
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        if latency_limit() == want {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn cpus_poll_while_requests_flow_and_halt_once_they_stop() {
    require(cannot_test());
    let relaxed = latency_limit();
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("f"), vec![7u8; 100_000]).unwrap();
    let (store, image) = (a.path("store"), a.path("image.cfs"));
    build_with_store(&src, &store, &image, &[]);

    for (when, polls) in [("on", true), ("off", false)] {
        let mnt = a.dir(&format!("mnt-{when}"));
        let out = tilefs_any(&[
            os("mount"),
            os("--fuse"),
            os("--idle-poll"),
            os(when),
            os("--store"),
            store.as_os_str(),
            image.as_os_str(),
            mnt.as_os_str(),
        ]);
        let _m = Mounted(mnt.clone());
        assert!(out.status.success(), "mount: {}", stderr(&out));
        let file = mnt.join("f");
        for round in 0..2 {
            let l = load(&file);
            if polls {
                assert!(
                    limit_becomes(0),
                    "--idle-poll on, round {round}: no 0 µs request while serving"
                );
            } else {
                std::thread::sleep(Duration::from_millis(200));
                assert_eq!(latency_limit(), relaxed, "--idle-poll off: the limit changed");
            }
            drop(l);
            // Let go within a few windows of 1 ms.
            assert!(
                limit_becomes(relaxed),
                "--idle-poll {when}, round {round}: the request stayed after the requests stopped (limit {})",
                latency_limit()
            );
            // ...and stays relaxed while idle.
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(
                latency_limit(),
                relaxed,
                "--idle-poll {when}: idle, yet the limit changed"
            );
        }
        assert_eq!(fs::read(&file).unwrap(), vec![7u8; 100_000]);
    }
    assert_eq!(latency_limit(), relaxed);
}
