//! Stores that other users may write (issue 27, items 5 and 9): what an
//! unprivileged user (uid 65534) plants in one must not make root write
//! outside the store, nor send root's registry credentials anywhere root
//! did not pull from.

mod common;

use common::oci::*;
use common::registry::{write_auth, Registry};
use common::*;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Why these tests cannot run here, if they cannot.
fn cannot_test() -> Option<String> {
    not_root("root is the victim, uid 65534 the other user")
}

/// An area nobody can reach, with a store root made and left writable by
/// all, and a directory of nobody's that must stay untouched.
fn shared_area() -> (Area, PathBuf, PathBuf) {
    let area = Area::new();
    fs::set_permissions(area.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let store = area.path("store");
    build_tag(&store, "base", &area.dir("empty"));
    fs::set_permissions(&store, fs::Permissions::from_mode(0o777)).unwrap();
    let outside = area.dir("outside");
    give_to_nobody(&outside);
    (area, store, outside)
}

/// Runs `sh -c script` as nobody; it must succeed.
fn nobody_sh(script: &str) {
    let out = as_nobody(Command::new("sh").args(["-c", script])).output().unwrap();
    assert!(out.status.success(), "as nobody: {script}: {}", stderr(&out));
}

/// What shows that nothing was written in a directory: its entries and
/// times (creating or removing an entry changes its mtime, even if the
/// entry is moved away again).
fn untouched(dir: &Path) -> (Vec<PathBuf>, i64, i64, i64, i64) {
    let m = fs::metadata(dir).unwrap();
    let entries = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    (entries, m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec())
}

/// A failed command (exit 1) whose message names `path`.
fn refused_naming(out: &Output, path: &Path, what: &str) {
    assert_eq!(out.status.code(), Some(1), "{what} should fail: {}", stderr(out));
    assert!(
        stderr(out).contains(&path.display().to_string()),
        "{what}: the message names {}: {}",
        path.display(),
        stderr(out)
    );
    eprintln!("{what}: {}", stderr(out).trim());
}

#[test]
fn symlinks_planted_in_a_shared_store_are_refused_not_written_through() {
    require(cannot_test());
    let (area, store, outside) = shared_area();
    let src = area.dir("src");
    let files = tree(&src, 27, 3, 5000);
    let target = &files[0].0;
    let fan = object_rel(&digest_hex(&src.join(target)))[..2].to_string();
    let planted = store.join(&fan);
    let build = || {
        tilefs_any(&[
            os("build"),
            os("-q"),
            os("--store"),
            store.as_os_str(),
            src.as_os_str(),
            area.path("img").as_os_str(),
        ])
    };

    // The object's fan-out directory is a symlink to nobody's directory:
    // refused (a symlink in a store is damage or an attack, never ours to
    // follow or to remove), naming it.
    nobody_sh(&format!("ln -s {} {}", outside.display(), planted.display()));
    let before = untouched(&outside);
    refused_naming(&build(), &planted, "build through a symlinked fan-out directory");
    assert_eq!(untouched(&outside), before, "nothing written outside the store");
    assert!(fs::symlink_metadata(&planted).unwrap().file_type().is_symlink());
    let text = tilefs_any(&[os("fsck"), os("--store"), store.as_os_str()]);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains(&planted.display().to_string()),
        "fsck reports it: {}",
        String::from_utf8_lossy(&text.stdout)
    );

    // The store's temporary directory, and its lock (dangling: opening it
    // with O_CREAT would create a file of root's outside).
    fs::remove_file(&planted).unwrap();
    for (name, plant) in [
        (
            ".tmp",
            format!(
                "mv {s}/.tmp {s}/.tmp-was && ln -s {o} {s}/.tmp",
                s = store.display(),
                o = outside.display()
            ),
        ),
        (
            ".lock",
            format!(
                "mv {s}/.lock {s}/.lock-was && ln -s {o}/made-by-root {s}/.lock",
                s = store.display(),
                o = outside.display()
            ),
        ),
    ] {
        nobody_sh(&plant);
        let before = untouched(&outside);
        refused_naming(&build(), &store.join(name), &format!("build with a symlinked {name}"));
        assert_eq!(untouched(&outside), before, "{name}: nothing written outside the store");
        fs::remove_file(store.join(name)).unwrap();
        fs::rename(store.join(format!("{name}-was")), store.join(name)).unwrap();
    }
    assert!(build().status.success(), "{}", stderr(&build()));

    // Pulls: the full pull and a lazy fetch write objects the same way.
    let registry = Registry::start(&area);
    let pushed = area.path("pushed");
    build_tag(&pushed, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&pushed, "app", &remote);
    let other = area.path("other-store");
    build_tag(&other, "base", &area.dir("empty-2"));
    fs::set_permissions(&other, fs::Permissions::from_mode(0o777)).unwrap();
    let planted = other.join(&fan);
    nobody_sh(&format!("ln -s {} {}", outside.display(), planted.display()));
    let before = untouched(&outside);
    refused_naming(
        &run_pull(&other, &remote, &[]),
        &planted,
        "pull through a symlinked fan-out directory",
    );
    assert_eq!(untouched(&outside), before, "nothing written outside the store");
    require(cannot_fuse());
    pull(&other, &remote, &["--lazy"]);
    let mnt = area.path("mnt");
    let log = area.path("fuse.log");
    let (_m, _) = mount_tag(&other, &format!("{}_team_app:v1", registry.addr), &mnt, &log);
    // (The server refuses the symlink on the way to the object before it
    // would fetch; a symlink planted during the fetch is refused as above.)
    let e = read(&mnt.join(target)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let logged = fs::read_to_string(&log).unwrap();
    eprintln!("lazy fetch: {logged}");
    assert!(
        logged.contains(target.as_str()) && logged.contains("symbolic links"),
        "{logged}"
    );
    assert_eq!(untouched(&outside), before, "nothing written outside the store");
}

/// A registry impostor on loopback: answers every request 401, asking for
/// HTTP Basic credentials, and remembers what it was sent.
struct Impostor {
    addr: String,
    requests: Arc<AtomicUsize>,
    credentials: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Impostor {
    fn start() -> Impostor {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (requests, credentials, stop) = Default::default();
        let me = Impostor {
            addr,
            requests,
            credentials,
            stop,
        };
        let (requests, credentials, stop) = (me.requests.clone(), me.credentials.clone(), me.stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let Ok((mut c, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                c.set_nonblocking(false).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut buf) {
                        Ok(n @ 1..) => head.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                }
                requests.fetch_add(1, Relaxed);
                if String::from_utf8_lossy(&head)
                    .to_lowercase()
                    .contains("\nauthorization:")
                {
                    credentials.store(true, Relaxed);
                }
                let _ = c.write_all(
                    b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"impostor\"\r\n\
                      Content-Length: 0\r\nConnection: close\r\n\r\n",
                );
            }
        });
        me
    }
}

impl Drop for Impostor {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

#[test]
fn lazy_records_in_a_shared_store_do_not_send_credentials_elsewhere() {
    require(cannot_test());
    require(cannot_fuse());
    let (area, store, _) = shared_area();
    let auth = area.path("auth.json");
    let registry = Registry::start_with_password(&area, "alice", "s3cret", &auth);
    let impostor = Impostor::start();
    assert_eq!(
        impostor.addr.len(),
        registry.addr.len(),
        "same-length addresses, for the edit below"
    );
    // Root's credentials: for the registry it pulls from, and for another
    // it logs in to (any of them is where a record could point).
    write_auth(&auth, &[&registry.addr, &impostor.addr], "alice:s3cret");
    let root = |args: &[&std::ffi::OsStr]| {
        Command::new(tilefs_bin())
            .args(args)
            .env("REGISTRY_AUTH_FILE", &auth)
            .env("HOME", area.path("home"))
            .env_remove("XDG_RUNTIME_DIR")
            .output()
            .unwrap()
    };
    let src = area.dir("src");
    let files = tree(&src, 9, 3, 5000);
    let pushed = area.path("pushed");
    build_tag(&pushed, "app", &src);
    let remote = format!("docker://{}/private/app:v1", registry.addr);
    let out = root(&[
        os("push"),
        os("-q"),
        os("--tls-verify=false"),
        os("--store"),
        pushed.as_os_str(),
        os("app"),
        os(&remote),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let pulled = root(&[
        os("pull"),
        os("-q"),
        os("--lazy"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
        os(&remote),
    ]);
    assert!(pulled.status.success(), "{}", stderr(&pulled));
    let tag = format!("{}_private_app:v1", registry.addr);
    let record = store
        .join(".remote")
        .join(String::from_utf8_lossy(&pulled.stdout).trim());
    let edited = area.path("edited-record");
    let bytes = fs::read(&record).unwrap();
    let at = bytes
        .windows(registry.addr.len())
        .position(|w| w == registry.addr.as_bytes())
        .unwrap();
    let mut pointed = bytes.clone();
    pointed[at..at + impostor.addr.len()].copy_from_slice(impostor.addr.as_bytes());
    fs::write(&edited, &pointed).unwrap();
    let mnt = area.dir("mnt");
    let log = area.path("fuse.log");
    let mount = || {
        let out = root(&[
            os("mount"),
            os("--store"),
            store.as_os_str(),
            os("--log"),
            log.as_os_str(),
            os(&tag),
            mnt.as_os_str(),
        ]);
        // (Before the fix, the mount was made: then a read shows where
        // the credentials went.)
        let m = out.status.success().then(|| Mounted(mnt.clone()));
        if m.is_some() {
            for (f, _) in &files {
                let _ = read(&mnt.join(f));
            }
        }
        (out, m)
    };

    // Root's own record in root's store, shared or not: the credentials go
    // to the registry root pulled from (one file read: the others are left
    // to fetch).
    let out = root(&[os("mount"), os("--store"), store.as_os_str(), os(&tag), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let m = Mounted(mnt.clone());
    assert_eq!(
        read(&mnt.join(&files[0].0)).unwrap(),
        fs::read(src.join(&files[0].0)).unwrap()
    );
    drop(m);

    let refused = |why: &str, what: &str| {
        let (out, m) = mount();
        drop(m);
        assert!(
            !impostor.credentials.load(Relaxed),
            "{what}: root's credentials went to the impostor"
        );
        assert_eq!(
            impostor.requests.load(Relaxed),
            0,
            "{what}: root's server went to the impostor"
        );
        assert!(!is_mounted(&mnt));
        refused_naming(&out, &record, what);
        assert!(stderr(&out).contains(why), "{what}: {}", stderr(&out));
    };
    // The other user swaps in a record of theirs pointing elsewhere.
    nobody_sh(&format!(
        "mv {s}/.remote {s}/.remote-was && mkdir {s}/.remote && cp {e} {r}",
        s = store.display(),
        e = edited.display(),
        r = record.display()
    ));
    refused("belongs to uid 65534", "a record of another user's");
    fs::remove_dir_all(store.join(".remote")).unwrap();
    fs::rename(store.join(".remote-was"), store.join(".remote")).unwrap();
    // Root's record, left writable by others, edited in place.
    fs::set_permissions(&record, fs::Permissions::from_mode(0o666)).unwrap();
    nobody_sh(&format!("cat {} > {}", edited.display(), record.display()));
    refused("others may write it (mode 0666)", "a record others may write");
    fs::write(&record, &bytes).unwrap();
    fs::set_permissions(&record, fs::Permissions::from_mode(0o644)).unwrap();
    // Root's untouched record in a store of the other user's.
    std::os::unix::fs::chown(&store, Some(NOBODY), Some(NOBODY)).unwrap();
    refused("belongs to uid 65534", "a store of another user's");
}
