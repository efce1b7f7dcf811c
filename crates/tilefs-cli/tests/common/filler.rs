//! The processes of a kernel lazy mount (its holder and filler) and
//! reads that go on while the filler is killed.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The processes (pid, parent) whose command line holds every one of
/// `needles` (the test's own process aside).
pub fn processes_naming(needles: &[&[u8]]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = fs::read(e.path().join("cmdline")).unwrap_or_default();
        let holds = |n: &[u8]| cmd.windows(n.len()).any(|w| w == n);
        if pid == std::process::id() || !needles.iter().all(|n| holds(n)) {
            continue;
        }
        let stat = fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        if let Some(ppid) = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().nth(1)?.parse().ok())
        {
            out.push((pid, ppid));
        }
    }
    out
}

/// The holder (whose parent is none of `servers`) and its child, the
/// filler.
pub fn holder_and_filler(servers: &[(u32, u32)]) -> (u32, u32) {
    let holder = servers
        .iter()
        .find(|(_, ppid)| !servers.iter().any(|(p, _)| p == ppid))
        .expect("a holder")
        .0;
    let filler = servers.iter().find(|(_, ppid)| *ppid == holder).expect("a filler").0;
    (holder, filler)
}

/// Reads `files` under `mnt`, three a thread, while `filler` is killed
/// with SIGKILL 150 ms in: each read gives the bytes of the same file
/// under `src` or EIO, never a wrong byte. Returns (read right, EIO).
pub fn reads_across_a_kill<P: AsRef<Path> + Sync>(mnt: &Path, src: &Path, files: &[P], filler: u32) -> (usize, usize) {
    std::thread::scope(|s| {
        let readers: Vec<_> = files
            .chunks(3)
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|f| {
                            let f = f.as_ref();
                            match fs::read(mnt.join(f)) {
                                Ok(got) => {
                                    assert!(got == fs::read(src.join(f)).unwrap(), "{}: wrong bytes", f.display());
                                    true
                                }
                                Err(e) => {
                                    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{}: {e}", f.display());
                                    false
                                }
                            }
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(150));
        let _ = Command::new("kill").args(["-9", &filler.to_string()]).status();
        let reads: Vec<bool> = readers.into_iter().flat_map(|r| r.join().unwrap()).collect();
        let right = reads.iter().filter(|r| **r).count();
        (right, reads.len() - right)
    })
}
