//! Helpers of the tests that push and pull through a real registry:
//! trees of pseudo-random files, images built, pushed and pulled with the
//! CLI, FUSE mounts that are always taken down, and what the registry sent.

use super::registry::Registry;
use super::*;
use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::process::Command;

/// Writes `files` (name, size) of pseudo-random bytes under `root`.
pub fn write_files(root: &Path, seed: u64, files: &[(String, usize)]) {
    let mut rng = Rng::new(seed);
    for (name, size) in files {
        let p = root.join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, rng.bytes(*size)).unwrap();
    }
}

/// A tree of `n` files of `size` bytes in a few directories, plus what
/// every image has: a small inline file, an empty one, a symlink.
pub fn tree(root: &Path, seed: u64, n: usize, size: usize) -> Vec<(String, usize)> {
    let files: Vec<(String, usize)> = (0..n).map(|i| (format!("d{}/f{i:03}", i % 5), size)).collect();
    write_files(root, seed, &files);
    fs::write(root.join("small"), b"inline contents").unwrap();
    fs::write(root.join("empty"), b"").unwrap();
    std::os::unix::fs::symlink("d0/f000", root.join("link")).unwrap();
    files
}

pub fn build_tag(store: &Path, tag: &str, src: &Path) -> String {
    tilefs(&[
        os("build"),
        os("-q"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os(tag),
        src.as_os_str(),
    ]);
    let out = tilefs(&[os("digest"), os("--store"), store.as_os_str(), os(tag)]);
    let d = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    d.trim_start_matches("sha256:").to_string()
}

pub fn push(store: &Path, tag: &str, remote: &str) -> serde_json::Value {
    let out = tilefs(&[
        os("push"),
        os("--json"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
        os(tag),
        os(remote),
    ]);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `tilefs pull -q --tls-verify=false --store STORE [extra] REMOTE`.
pub fn run_pull(store: &Path, remote: &str, extra: &[&str]) -> std::process::Output {
    let mut args: Vec<&OsStr> = vec![
        os("pull"),
        os("-q"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
    ];
    args.extend(extra.iter().map(|s| os(s)));
    args.push(os(remote));
    tilefs_any(&args)
}

/// A pull that succeeds; the digest it prints.
pub fn pull(store: &Path, remote: &str, extra: &[&str]) -> String {
    let out = run_pull(store, remote, extra);
    assert!(out.status.success(), "pull {remote}: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A pull that fails (exit 1); its message.
pub fn pull_fails(store: &Path, remote: &str, extra: &[&str]) -> String {
    let out = run_pull(store, remote, extra);
    assert_eq!(out.status.code(), Some(1), "pull should fail: {}", stderr(&out));
    stderr(&out)
}

pub fn fsck_text(store: &Path) -> String {
    let out = tilefs_any(&[os("fsck"), os("--store"), store.as_os_str()]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &stderr(&out);
    assert!(out.status.success(), "fsck: {text}");
    text
}

/// After a failed pull: the store it created is gone, or it is clean.
pub fn assert_clean_or_gone(store: &Path) {
    if store.exists() {
        assert!(fsck_text(store).contains("clean"));
    }
}

/// Objects present in a store.
pub fn objects_in(store: &Path) -> usize {
    fs::read_dir(store)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().len() == 2)
        .map(|e| fs::read_dir(e.path()).unwrap().count())
        .sum()
}

pub fn skopeo_raw(remote: &str) -> serde_json::Value {
    let out = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false", remote])
        .output()
        .expect("skopeo (scripts/setup installs it)");
    assert!(out.status.success(), "skopeo inspect: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Bytes of blob GETs logged since `before` requests.
pub fn blob_bytes_since(r: &Registry, before: usize) -> u64 {
    r.requests()[before..]
        .iter()
        .filter(|q| q.method == "GET" && q.path.contains("/blobs/"))
        .map(|q| q.bytes)
        .sum()
}

/// Mounts the tag `tag` of `store` with FUSE (a lazy image's objects
/// fetched when read, logging to `log`) at `mnt`: the mount, taken down
/// when dropped, and what the command said. (tests/kernel_lazy.rs mounts
/// lazy images with the kernel.)
pub fn mount_tag(store: &Path, tag: &str, mnt: &Path, log: &Path) -> (Mounted, String) {
    fs::create_dir_all(mnt).unwrap();
    let out = tilefs_any(&[
        os("mount"),
        os("--fuse"),
        os("--store"),
        store.as_os_str(),
        os("--log"),
        log.as_os_str(),
        os(tag),
        mnt.as_os_str(),
    ]);
    assert!(out.status.success(), "mount: {}", stderr(&out));
    (Mounted(mnt.to_path_buf()), stderr(&out))
}

/// Reads a file the way `cat` would: contents, or the OS error.
pub fn read(p: &Path) -> std::io::Result<Vec<u8>> {
    fs::read(p)
}

/// Runs `cmd`, which must succeed; its stdout.
pub fn checked(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An OCI image in `registry` as `tilefs/NAME:v1`: a layer made with umoci
/// from each tree a function of `layers` fills, its config set by umoci's
/// `config` flags (`--config.cmd`, `--config.entrypoint`, ...), pushed with
/// skopeo. Returns its reference.
pub fn push_image_with(
    area: &Area,
    registry: &Registry,
    name: &str,
    layers: &[&dyn Fn(&Path)],
    config: &[&str],
) -> String {
    push_image_as(area, registry, name, layers, config, &[])
}

/// [`push_image_with`], skopeo given `copy_flags` too (as
/// `--dest-compress-format zstd`).
pub fn push_image_as(
    area: &Area,
    registry: &Registry,
    name: &str,
    layers: &[&dyn Fn(&Path)],
    config: &[&str],
    copy_flags: &[&str],
) -> String {
    push_image_to(area, &registry.addr, name, layers, config, copy_flags)
}

/// [`push_image_as`] to the registry at `addr` (`127.0.0.1:PORT`).
pub fn push_image_to(
    area: &Area,
    addr: &str,
    name: &str,
    layers: &[&dyn Fn(&Path)],
    config: &[&str],
    copy_flags: &[&str],
) -> String {
    let layout = area.path(&format!("layout-{name}"));
    let bundle = area.path(&format!("bundle-{name}"));
    let lay = format!("{}:{name}", layout.display());
    checked(Command::new("umoci").args(["init", "--layout"]).arg(&layout));
    checked(Command::new("umoci").args(["new", "--image", &lay]));
    for fill in layers {
        let _ = fs::remove_dir_all(&bundle);
        checked(Command::new("umoci").args(["unpack", "--image", &lay]).arg(&bundle));
        fill(&bundle.join("rootfs"));
        checked(Command::new("umoci").args(["repack", "--image", &lay]).arg(&bundle));
    }
    checked(Command::new("umoci").args(["config", "--image", &lay]).args(config));
    let remote = format!("{addr}/tilefs/{name}:v1");
    checked(
        Command::new("skopeo")
            .args(["copy", "-q", "--dest-tls-verify=false"])
            .args(copy_flags)
            .args([format!("oci:{lay}"), format!("docker://{remote}")]),
    );
    remote
}

/// A new version of the image [`push_image_with`] made as `NAME`: a layer
/// more on top of its layers (the same blobs), filled by `fill`, pushed
/// as `tilefs/NAME:TAG` to the registry at `addr`. Returns its reference.
pub fn push_next_version(area: &Area, addr: &str, name: &str, tag: &str, fill: &dyn Fn(&Path)) -> String {
    let layout = area.path(&format!("layout-{name}"));
    let bundle = area.path(&format!("bundle-{name}"));
    let lay = format!("{}:{name}", layout.display());
    let _ = fs::remove_dir_all(&bundle);
    checked(Command::new("umoci").args(["unpack", "--image", &lay]).arg(&bundle));
    fill(&bundle.join("rootfs"));
    checked(Command::new("umoci").args(["repack", "--image", &lay]).arg(&bundle));
    let remote = format!("{addr}/tilefs/{name}:{tag}");
    checked(Command::new("skopeo").args([
        "copy",
        "-q",
        "--dest-tls-verify=false",
        &format!("oci:{lay}"),
        &format!("docker://{remote}"),
    ]));
    remote
}

/// The host's static busybox as `root/bin/busybox`, with `applets` as
/// symlinks to it.
pub fn busybox_into(root: &Path, applets: &[&str]) {
    fs::create_dir_all(root.join("bin")).unwrap();
    fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for app in applets {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(app)).unwrap();
    }
}

/// A command watched as it ran.
pub struct Watched {
    /// Its status, and the first 64 KiB of its stdout and stderr.
    pub out: std::process::Output,
    /// Its peak resident memory (VmHWM, read every 10 ms), in MiB.
    pub peak_mib: u64,
    pub took: std::time::Duration,
    /// From the signal it was sent to its exit.
    pub after_signal: Option<std::time::Duration>,
}

/// Runs `cmd` to its end, watching its memory; sends it `signal` (a name
/// for kill(1)) once `after` has passed; kills it past `limit` (its status
/// then says so). It is killed if the test fails meanwhile.
pub fn watch(mut cmd: Command, signal: Option<(&str, std::time::Duration)>, limit: std::time::Duration) -> Watched {
    use std::io::Read;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let started = Instant::now();
    let mut child = Reaped(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Drained as they come (an error message could be huge), kept short.
    let drain = |r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let mut r = r;
            let mut buf = [0u8; 64 << 10];
            while let Ok(n @ 1..) = r.read(&mut buf) {
                let room = (64 << 10) - kept.len().min(64 << 10);
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
            kept
        })
    };
    let stdout = drain(Box::new(child.0.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.0.stderr.take().unwrap()));
    let pid = child.0.id();
    let hwm = || {
        fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))?
            .trim()
            .trim_end_matches(" kB")
            .parse::<u64>()
            .ok()
    };
    let (mut peak_kib, mut signalled) = (0, None);
    let status = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        peak_kib = peak_kib.max(hwm().unwrap_or(0));
        if let (Some((sig, after)), None) = (signal, signalled) {
            if started.elapsed() >= after {
                Command::new("kill")
                    .arg(format!("-{sig}"))
                    .arg(pid.to_string())
                    .status()
                    .unwrap();
                signalled = Some(Instant::now());
            }
        }
        if started.elapsed() > limit {
            let _ = child.0.kill();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (took, after_signal) = (started.elapsed(), signalled.map(|s| s.elapsed()));
    Watched {
        out: std::process::Output {
            status,
            stdout: stdout.join().unwrap(),
            stderr: stderr.join().unwrap(),
        },
        peak_mib: peak_kib / 1024,
        took,
        after_signal,
    }
}
