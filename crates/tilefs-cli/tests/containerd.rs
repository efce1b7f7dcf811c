//! `tilefs snapshotter` under a real containerd (Debian's), with runc and
//! images in Debian's docker-registry on loopback: pull, run, snapshot
//! commands, file-level dedup across images, gc, restarts, hostile keys.
//! Every daemon and mount the test starts is stopped and removed when it
//! ends, whether it passes or not.

mod common;

use common::oci::objects_in;
use common::registry::Registry;
use common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    out
}

/// A command that must succeed; its stdout.
use common::oci::checked as ok;

/// `ctr snapshots view KEY PARENT` through `snaps` (`ctr ... snapshots
/// --snapshotter S`), kept as a gc root. `view`, unlike `prepare` and
/// `commit`, gives no `containerd.io/gc.root` label, so containerd's gc
/// (scheduled after any removal, as after a pull) may take the view away
/// before `label` reaches it: then it is made again. Err is what ctr
/// printed.
fn view_kept(snaps: &Command, key: &str, parent: &str) -> Result<(), String> {
    let ctr = |args: &[&str]| run(Command::new(snaps.get_program()).args(snaps.get_args()).args(args));
    for _ in 0..5 {
        let out = ctr(&["view", key, parent]);
        if !out.status.success() {
            return Err(stderr(&out));
        }
        let out = ctr(&["label", key, "containerd.io/gc.root=test"]);
        if out.status.success() {
            return Ok(());
        }
        let said = stderr(&out);
        assert!(said.contains("not found"), "labelling view {key}: {said}");
    }
    panic!("view {key}: containerd's gc took it away five times before it could be labelled");
}

/// containerd, the snapshotter and what they mounted; all stopped and
/// removed on drop.
struct Rig {
    area: PathBuf,
    sock: PathBuf,
    snap_sock: PathBuf,
    root: PathBuf,
    store: PathBuf,
    containerd: Option<Child>,
    snapshotter: Option<Child>,
    registry: Option<Registry>,
    /// containerd's namespace, one per rig: its cgroup is removed after.
    ns: String,
}

impl Rig {
    fn start(area: &Area) -> Rig {
        let base = area.path("");
        let mut rig = Rig {
            area: base.clone(),
            sock: base.join("c.sock"),
            snap_sock: base.join("s.sock"),
            root: base.join("snaproot"),
            store: base.join("store"),
            containerd: None,
            snapshotter: None,
            registry: Some(Registry::start(area)),
            ns: format!(
                "tilefs-test-{}",
                base.to_string_lossy()
                    .chars()
                    .filter(char::is_ascii_alphanumeric)
                    .collect::<String>()
            ),
        };
        rig.start_snapshotter();
        let config = base.join("containerd.toml");
        fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{r}\"\nstate = \"{s}\"\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{a}\"\n[ttrpc]\n  address = \"{a}.ttrpc\"\n\
                 [proxy_plugins]\n  [proxy_plugins.tilefs]\n    type = \"snapshot\"\n    address = \"{p}\"\n",
                r = base.join("croot").display(),
                s = base.join("cstate").display(),
                a = rig.sock.display(),
                p = rig.snap_sock.display(),
            ),
        )
        .unwrap();
        let log = fs::File::create(base.join("containerd.log")).unwrap();
        rig.containerd = Some(
            Command::new("containerd")
                .arg("--config")
                .arg(&config)
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("containerd (scripts/setup installs it)"),
        );
        let t = Instant::now();
        while !run(rig.ctr().arg("version")).status.success() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "containerd did not start: {}",
                fs::read_to_string(base.join("containerd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        rig
    }

    fn start_snapshotter(&mut self) {
        self.snapshotter = Some(common::spawn_snapshotter(
            &self.root,
            &self.store,
            &self.snap_sock,
            // Removed snapshots' objects collected a second after; the
            // lazy path (`tilefs pull --containerd`) reaches the registry
            // over plain HTTP.
            &["--gc-delay", "1", "--tls-verify=false"],
            &self.area.join("snapshotter.log"),
        ));
        // containerd's gRPC client reconnects to a restarted plugin after
        // its backoff (a second or more): wait until it has.
        if self.containerd.is_some() {
            let t = Instant::now();
            while !run(self.snapshots().arg("ls")).status.success() {
                assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "containerd did not reconnect to the snapshotter"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }

    fn stop_snapshotter(&mut self, signal: &str) {
        common::stop_child(&mut self.snapshotter, signal);
    }

    fn ctr(&self) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address").arg(&self.sock).arg("--namespace").arg(&self.ns);
        c
    }

    fn snapshots(&self) -> Command {
        let mut c = self.ctr();
        c.args(["snapshots", "--snapshotter", "tilefs"]);
        c
    }

    /// A view of `parent`, kept as a gc root (see [`view_kept`]).
    /// Err is what ctr printed.
    fn view(&self, key: &str, parent: &str) -> Result<(), String> {
        view_kept(&self.snapshots(), key, parent)
    }

    fn registry(&self) -> &Registry {
        self.registry.as_ref().unwrap()
    }

    fn pull(&self, reference: &str) {
        ok(self
            .ctr()
            .args(["images", "pull", "--plain-http", "--snapshotter", "tilefs", reference]));
    }

    /// `ctr run --rm` of `cmd` in `image`; its output.
    fn run_in(&self, image: &str, id: &str, cmd: &str) -> String {
        ok(self.ctr().args([
            "run",
            "--rm",
            "--snapshotter",
            "tilefs",
            image,
            id,
            "/bin/sh",
            "-c",
            cmd,
        ]))
    }

    /// Waits until the snapshotter stored every committed snapshot's layer
    /// (it does after Commit returns): one held image each.
    fn settle(&self) {
        let t = Instant::now();
        loop {
            let (tags, committed) = (held_images(&self.store).len(), self.committed().len());
            if tags == committed {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "{committed} committed snapshots, {tags} stored"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Committed snapshots: (key, parent).
    fn committed(&self) -> Vec<(String, String)> {
        let out = ok(self.snapshots().arg("ls"));
        out.lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f.as_slice() {
                    [k, p, "Committed"] => Some((k.to_string(), p.to_string())),
                    [k, "Committed"] => Some((k.to_string(), String::new())),
                    _ => None,
                }
            })
            .collect()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in ["snapshotter.log", "containerd.log"] {
                let text = fs::read_to_string(self.area.join(log)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(30).collect();
                eprintln!("--- {log} (last lines):");
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        // Tasks and containers first (their mounts), then the daemons.
        if self.containerd.is_some() {
            if let Ok(o) = self.ctr().args(["tasks", "ls", "-q"]).output() {
                for id in String::from_utf8_lossy(&o.stdout).lines() {
                    let _ = self.ctr().args(["tasks", "kill", "-s", "SIGKILL", id]).output();
                    std::thread::sleep(Duration::from_millis(200));
                    let _ = self.ctr().args(["tasks", "delete", "-f", id]).output();
                }
            }
            if let Ok(o) = self.ctr().args(["containers", "ls", "-q"]).output() {
                for id in String::from_utf8_lossy(&o.stdout).lines() {
                    let _ = self.ctr().args(["containers", "delete", id]).output();
                }
            }
        }
        if let Some(mut c) = self.containerd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        common::remove_cgroup(&self.ns);
        self.stop_snapshotter("-TERM");
        if let Some(mut r) = self.registry.take() {
            r.stop();
        }
        // Whatever is still mounted below the area, deepest first.
        let mut mounts: Vec<String> = fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .filter(|m| Path::new(m).starts_with(&self.area))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let _ = Command::new("umount").args(["-l", &m]).status();
        }
    }
}

/// An OCI image in a registry: layers made with umoci from the trees
/// `layers` fills, pushed with skopeo.
fn push_image(area: &Area, registry: &Registry, name: &str, layers: &[&dyn Fn(&Path)]) -> String {
    common::oci::push_image_with(area, registry, name, layers, &["--config.cmd", "/bin/sh"])
}

/// A base layer: busybox and its applets, and `shared` files of 64 KiB
/// named by seed (the same seed, the same bytes).
fn base_layer(root: &Path, shared: u64, own_seed: u64, own: usize) {
    common::oci::busybox_into(
        root,
        &[
            "sh", "cat", "echo", "test", "ls", "md5sum", "sleep", "rm", "mkdir", "stat", "chmod", "mv",
        ],
    );
    fs::create_dir_all(root.join("data")).unwrap();
    for i in 0..shared {
        fs::write(
            root.join(format!("data/shared-{i}")),
            Rng::new(1000 + i).bytes(64 << 10),
        )
        .unwrap();
    }
    for i in 0..own {
        fs::write(
            root.join(format!("data/own-{i}")),
            Rng::new(own_seed + i as u64).bytes(48 << 10),
        )
        .unwrap();
    }
    fs::create_dir_all(root.join("tmp")).unwrap();
    fs::write(root.join("data/gone"), b"removed by the next layer, a whiteout then").unwrap();
    fs::create_dir_all(root.join("opaque/old")).unwrap();
    fs::write(root.join("opaque/old/file"), b"hidden by an opaque directory above").unwrap();
}

fn top_layer(root: &Path, msg: &str) {
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::write(root.join("etc/msg"), msg).unwrap();
    fs::remove_file(root.join("data/gone")).unwrap();
    fs::remove_dir_all(root.join("opaque")).unwrap();
    fs::create_dir_all(root.join("opaque")).unwrap();
    fs::write(root.join("opaque/new"), b"new").unwrap();
    fs::write(root.join("data/shared-0"), Rng::new(7).bytes(100 << 10)).unwrap();
}

fn require_tools() {
    assert!(is_root(), "the containerd tests run as root");
    for t in ["containerd", "ctr", "runc", "docker-registry", "skopeo", "umoci"] {
        assert!(have(t), "{t} is needed (scripts/setup installs it)");
    }
    assert!(
        Path::new("/bin/busybox").exists(),
        "busybox-static is needed (scripts/setup installs it)"
    );
}

#[test]
fn containerd_pulls_runs_and_shares_files_through_tilefs() {
    require_tools();
    let area = Area::new();
    let mut rig = Rig::start(&area);
    let a = push_image(
        &area,
        rig.registry(),
        "a",
        &[&|r: &Path| base_layer(r, 12, 5000, 4), &|r: &Path| {
            top_layer(r, "hello from a")
        }],
    );
    let b = push_image(
        &area,
        rig.registry(),
        "b",
        &[&|r: &Path| base_layer(r, 12, 9000, 3), &|r: &Path| {
            top_layer(r, "hello from b")
        }],
    );

    // Pull: containerd fetches and unpacks into our snapshots.
    rig.pull(&a);
    let committed = rig.committed();
    assert_eq!(committed.len(), 2, "one committed snapshot per layer: {committed:?}");
    rig.settle();
    let objects_a = objects_in(&rig.store);
    // busybox, 12 shared, 4 own, the new shared-0 (the old one stays in the
    // lower layer's image).
    assert_eq!(objects_a, 1 + 12 + 4 + 1, "objects after pulling a");
    // The upper directories of committed snapshots are gone: their files
    // were moved, not copied (the names are removed in the background).
    let t = Instant::now();
    for e in fs::read_dir(rig.root.join("snapshots")).unwrap().flatten() {
        while e.path().join("fs").exists() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{}: a committed layer keeps its upper",
                e.path().display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    // The flattened image of the chain is the one `tilefs pull` makes, but
    // for the mtimes of directories that containerd's differ changed after
    // it applied their headers (creating whiteouts or entries in them): the
    // same entries, files, objects, modes, owners and xattrs.
    let pulled_store = area.dir("pulled");
    let digest = common::oci::pull(&pulled_store, &format!("docker://{a}"), &["--tag", "a"]);
    let ours = held_images(&rig.store)
        .into_iter()
        .max_by_key(|p| {
            p.to_string_lossy()
                .rsplit('-')
                .next()
                .and_then(|n| n.parse::<u64>().ok())
        })
        .unwrap();
    if digest_hex(&ours) != digest {
        let dump = |p: &Path| {
            ok(Command::new(tilefs_bin()).arg("dump").arg(p))
                .lines()
                .map(|l| {
                    let mut f: Vec<&str> = l.split(' ').collect();
                    if f.len() > 7 && f[2].starts_with("40") {
                        f[7] = "-";
                    }
                    f.join(" ")
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            dump(&ours),
            dump(&pulled_store.join("images/a")),
            "the chain's image and the pull's"
        );
    }
    // Run: the image's files, whiteouts and opaque directories honoured,
    // writes kept in the container.
    let out = rig.run_in(
        &a,
        "c1",
        "cat /etc/msg; echo; test -e /data/gone || echo gone; ls /opaque; echo scribble > /data/shared-1; \
         cat /data/shared-1; chmod 600 /data/shared-2; stat -c %a /data/shared-2; md5sum /data/own-0",
    );
    let want_md5 = {
        let p = area.path("own0");
        fs::write(&p, Rng::new(5000).bytes(48 << 10)).unwrap();
        let o = ok(Command::new("md5sum").arg(&p));
        o.split_whitespace().next().unwrap().to_string()
    };
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "hello from a",
            "gone",
            "new",
            "scribble",
            "600",
            &format!("{want_md5}  /data/own-0")
        ],
        "{out}"
    );
    let out = rig.run_in(&a, "c2", "md5sum /data/shared-1; stat -c %a /data/shared-2");
    let want = {
        let p = area.path("shared1");
        fs::write(&p, Rng::new(1001).bytes(64 << 10)).unwrap();
        ok(Command::new("md5sum").arg(&p))
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [format!("{want}  /data/shared-1"), "644".into()]
    );

    // A second image sharing files: only its own files are new objects.
    // The first try is killed (-9) midway; the next one after a restart
    // finds nothing half made.
    let mut first = rig
        .ctr()
        .args(["images", "pull", "--plain-http", "--snapshotter", "tilefs", &b])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    rig.stop_snapshotter("-KILL");
    let _ = first.wait();
    rig.start_snapshotter();
    rig.pull(&b);
    // A Commit the kill cut off after it was stored but before containerd
    // heard back left a snapshot containerd does not know: its next gc
    // removes it (run now, synchronously), and the snapshotter lets go.
    ok(rig.ctr().args(["leases", "create", "--id", "gc-now"]));
    ok(rig.ctr().args(["leases", "delete", "--sync", "gc-now"]));
    rig.settle();
    assert_eq!(
        objects_in(&rig.store),
        objects_a + 3,
        "pulling b stores only b's own 3 files"
    );
    assert_eq!(rig.run_in(&b, "c3", "cat /etc/msg"), "hello from b");

    // Snapshot commands.
    let (top, _) = rig.committed().into_iter().find(|(_, p)| !p.is_empty()).unwrap();
    let info = ok(rig.snapshots().args(["info", &top]));
    assert!(info.contains("\"Kind\": \"Committed\""), "{info}");
    let usage = ok(rig.snapshots().args(["usage", &top]));
    assert!(usage.lines().count() >= 2, "{usage}");
    // Hostile keys: kept as keys, never as paths.
    for key in ["../../escape", "a/b/../../c", "/abs"] {
        ok(rig.snapshots().args(["prepare", key, &top]));
        let mounts = ok(rig.snapshots().args(["mounts", "/mnt", key]));
        assert!(mounts.contains("overlay"), "{mounts}");
        let info = ok(rig.snapshots().args(["info", key]));
        assert!(info.contains("\"Kind\": \"Active\""), "{info}");
    }
    assert!(!area.path("escape").exists() && !rig.root.join("../escape").exists());
    for key in ["../../escape", "a/b/../../c", "/abs"] {
        ok(rig.snapshots().args(["rm", key]));
    }
    // Errors containerd understands.
    let dup = run(rig.snapshots().args(["prepare", "x", &top]));
    assert!(dup.status.success());
    let again = run(rig.snapshots().args(["prepare", "x", &top]));
    assert!(
        !again.status.success() && stderr(&again).contains("already exists"),
        "{}",
        stderr(&again)
    );
    let parent_busy = run(rig.snapshots().args(["rm", &top]));
    assert!(!parent_busy.status.success(), "a parent with children is not removed");
    let missing = run(rig.snapshots().args(["info", "no-such"]));
    assert!(
        !missing.status.success() && stderr(&missing).contains("not found"),
        "{}",
        stderr(&missing)
    );
    ok(rig.snapshots().args(["rm", "x"]));

    // A restart keeps every snapshot; a running container goes on reading
    // its files (the kernel serves them), new ones start.
    ok(rig
        .ctr()
        .args(["run", "-d", "--snapshotter", "tilefs", &a, "long", "/bin/sleep", "1000"]));
    let before = ok(rig.snapshots().arg("ls"));
    rig.stop_snapshotter("-KILL");
    rig.start_snapshotter();
    assert_eq!(ok(rig.snapshots().arg("ls")), before);
    let out = ok(rig.ctr().args([
        "tasks",
        "exec",
        "--exec-id",
        "e1",
        "long",
        "/bin/sh",
        "-c",
        "cat /etc/msg; echo; md5sum /data/own-0",
    ]));
    assert_eq!(out.lines().next(), Some("hello from a"), "{out}");
    assert!(out.contains(&want_md5), "{out}");
    assert_eq!(rig.run_in(&a, "c4", "cat /etc/msg"), "hello from a");

    // What a running container uses is never collected: the snapshotter's
    // images are listed apart from the user's tags, `untag` refuses them
    // naming their holder, gc keeps their objects and the container reads
    // on (from the disk: caches dropped).
    let held = held_images(&rig.store);
    assert_eq!(held.len(), rig.committed().len(), "{held:?}");
    assert!(tags_in(&rig.store).is_empty(), "{:?}", tags_in(&rig.store));
    let holder = format!("held by the containerd snapshotter at {}", rig.root.display());
    let listing = ok(Command::new(tilefs_bin()).args(["images", "--store"]).arg(&rig.store));
    let (mine, theirs) = listing
        .split_once(&holder)
        .unwrap_or_else(|| panic!("no section of held images: {listing}"));
    let names: Vec<&str> = held.iter().map(|p| p.file_name().unwrap().to_str().unwrap()).collect();
    assert!(
        names.iter().all(|n| theirs.contains(n) && !mine.contains(n)),
        "{listing}"
    );
    let json: serde_json::Value = serde_json::from_str(&ok(Command::new(tilefs_bin())
        .args(["images", "--json", "--store"])
        .arg(&rig.store)))
    .unwrap();
    assert!(
        json.as_array().unwrap().iter().all(|r| r["owner"]["kind"] == "containerd-snapshotter"
            && r["owner"]["root"] == rig.root.to_str().unwrap()),
        "{json}"
    );
    for name in &names {
        let out = run(Command::new(tilefs_bin())
            .args(["untag", "--store"])
            .arg(&rig.store)
            .arg(name));
        assert!(!out.status.success(), "untag of {name} was not refused");
        let why = stderr(&out);
        assert!(
            why.contains(&holder) && why.contains("when containerd removes the snapshot"),
            "{why}"
        );
    }
    let gc = |store: &Path| -> serde_json::Value {
        serde_json::from_str(&ok(Command::new(tilefs_bin())
            .args(["gc", "--json", "--store"])
            .arg(store)))
        .unwrap()
    };
    let r = gc(&rig.store);
    assert_eq!(
        (r["objects_removed"].as_u64(), r["held"].as_u64()),
        (Some(0), Some(held.len() as u64)),
        "{r}"
    );
    let exec_reads = |rig: &Rig, id: &str| {
        let _ = fs::write("/proc/sys/vm/drop_caches", "3");
        let out = ok(rig.ctr().args([
            "tasks",
            "exec",
            "--exec-id",
            id,
            "long",
            "/bin/sh",
            "-c",
            "cat /etc/msg; echo; md5sum /data/own-0",
        ]));
        assert_eq!(out.lines().next(), Some("hello from a"), "{out}");
        assert!(out.contains(&want_md5), "{out}");
    };
    exec_reads(&rig, "e2");
    // A store of an older tilefs, whose snapshotter tagged its images in
    // images/ as the user's: the next start holds them again, each written
    // held before its tag goes.
    rig.stop_snapshotter("-KILL");
    fs::create_dir_all(rig.store.join("images")).unwrap();
    for p in &held {
        fs::rename(p, rig.store.join("images").join(p.file_name().unwrap())).unwrap();
    }
    fs::remove_dir_all(rig.store.join(".owned")).unwrap();
    rig.start_snapshotter();
    assert_eq!(held_images(&rig.store), held, "not held again after the start");
    assert!(tags_in(&rig.store).is_empty(), "{:?}", tags_in(&rig.store));
    assert_eq!(gc(&rig.store)["objects_removed"].as_u64(), Some(0));
    exec_reads(&rig, "e3");
    ok(rig.ctr().args(["tasks", "kill", "-s", "SIGKILL", "long"]));
    let t = Instant::now();
    while !run(rig.ctr().args(["tasks", "delete", "long"])).status.success() {
        assert!(t.elapsed() < Duration::from_secs(20), "the task did not stop");
        std::thread::sleep(Duration::from_millis(100));
    }
    ok(rig.ctr().args(["containers", "delete", "long"]));

    // gc: the images removed, containerd removes their snapshots, and the
    // snapshotter frees their objects a second after, with no `tilefs gc`.
    ok(rig.ctr().args(["images", "rm", "--sync", &a, &b]));
    let t = Instant::now();
    while !rig.committed().is_empty() || objects_in(&rig.store) > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "containerd's gc left {:?}, and {} objects are left",
            rig.committed(),
            objects_in(&rig.store)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = fs::read_to_string(rig.area.join("snapshotter.log")).unwrap();
    assert!(log.contains("snapshotter") && log.contains(": collected "), "{log}");
    assert!(held_images(&rig.store).is_empty());
    assert_eq!(
        gc(&rig.store)["objects_removed"].as_u64(),
        Some(0),
        "left for a manual gc"
    );
    let leftover: Vec<_> = fs::read_dir(rig.root.join("snapshots")).unwrap().flatten().collect();
    assert!(leftover.is_empty(), "{leftover:?}");
    drop(rig);
}

/// Mounts snapshot `key` at `target` as containerd would (the mounts
/// `ctr snapshots mounts` prints).
fn mount_snapshot(rig: &Rig, key: &str, target: &Path) {
    let cmd = ok(rig.snapshots().arg("mounts").arg(target).arg(key));
    ok(Command::new("sh").args(["-c", cmd.trim()]));
}

fn umount(target: &Path) {
    ok(Command::new("umount").arg(target));
}

/// The upper directory of the snapshot that holds `rel`.
fn upper_holding(rig: &Rig, rel: &str) -> PathBuf {
    fs::read_dir(rig.root.join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("fs"))
        .find(|fs| fs.join(rel).symlink_metadata().is_ok())
        .unwrap_or_else(|| panic!("no upper directory holds {rel}"))
}

fn xattr_value(p: &Path, name: &str) -> Option<Vec<u8>> {
    let out = run(Command::new("getfattr")
        .args(["--absolute-names", "--only-values", "-n", name])
        .arg(p));
    out.status.success().then_some(out.stdout)
}

/// Every entry below `root` (not followed): type, mode, owner, size, a
/// digest of a file's bytes or a symlink's target.
fn tree_of(root: &Path) -> std::collections::BTreeMap<String, String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let m = p.symlink_metadata().unwrap();
            let what = if m.is_dir() {
                stack.push(p.clone());
                "dir".to_string()
            } else if m.file_type().is_symlink() {
                format!("-> {}", fs::read_link(&p).unwrap().display())
            } else if m.is_file() {
                format!("{} bytes {}", m.len(), sha256_hex(&fs::read(&p).unwrap()))
            } else {
                format!("special {:x}", m.rdev())
            };
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            out.insert(rel, format!("{:o} {}:{} {what}", m.mode(), m.uid(), m.gid()));
        }
    }
    out
}

/// Takes the immutable flag off a directory when dropped (a test that fails
/// must not leave a directory its area cannot remove).
struct Immutable(PathBuf);

impl Immutable {
    fn set(p: &Path) -> Immutable {
        ok(Command::new("chattr").arg("+i").arg(p));
        Immutable(p.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

#[test]
fn a_failed_commit_gives_the_snapshot_back_and_renamed_directories_commit() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    require_tools();
    for t in ["chattr", "getfattr", "setfattr"] {
        assert!(have(t), "{t} is needed (scripts/setup installs e2fsprogs and attr)");
    }
    let area = Area::new();
    let rig = Rig::start(&area);
    let a = push_image(
        &area,
        rig.registry(),
        "a",
        &[&|r: &Path| base_layer(r, 3, 5000, 2), &|r: &Path| {
            top_layer(r, "hello from a")
        }],
    );
    rig.pull(&a);
    let (top, _) = rig.committed().into_iter().find(|(_, p)| !p.is_empty()).unwrap();

    // An active snapshot with a setuid file of another owner, with a file
    // capability and two names, and a file the store holds already.
    ok(rig.snapshots().args(["prepare", "act", &top]));
    let m = area.dir("m");
    mount_snapshot(&rig, "act", &m);
    let data = Rng::new(77).bytes(100 << 10);
    fs::write(m.join("data/suid"), &data).unwrap();
    std::os::unix::fs::chown(m.join("data/suid"), Some(1000), Some(1000)).unwrap();
    fs::set_permissions(m.join("data/suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    // CAP_NET_RAW, permitted and effective (VFS_CAP_REVISION_2).
    let cap = "0x0100000200200000000000000000000000000000";
    let cap_raw: &[u8] = &[1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    ok(Command::new("setfattr")
        .args(["-n", "security.capability", "-v", cap])
        .arg(m.join("data/suid")));
    fs::hard_link(m.join("data/suid"), m.join("data/suid-link")).unwrap();
    fs::write(m.join("data/dup"), Rng::new(1001).bytes(64 << 10)).unwrap();
    umount(&m);
    let upper = upper_holding(&rig, "data/suid");
    let before = fs::symlink_metadata(upper.join("data/suid")).unwrap();
    assert_eq!(
        xattr_value(&upper.join("data/suid"), "security.capability").as_deref(),
        Some(cap_raw)
    );

    // Storing the layer fails at its very end (the store's tags cannot be
    // written), after the files went into the store: the Commit itself
    // succeeded (it only switches the record), a mount on it fails.
    let v = area.dir("v1");
    {
        let _frozen = Immutable::set(held_images(&rig.store)[0].parent().unwrap());
        ok(rig.snapshots().args(["commit", "done", "act"]));
        let err = rig
            .view("v1", "done")
            .expect_err("a view over a layer the store could not tag");
        eprintln!("the failed view: {err}");
        assert!(err.contains("could not be stored"), "{err}");
        // The upper directory is as it was: its file's owner, mode, names,
        // capability and bytes; its inode no longer the store's.
        let f = upper.join("data/suid");
        let after = fs::symlink_metadata(&f).unwrap();
        assert_eq!((after.uid(), after.gid()), (1000, 1000));
        assert_eq!(after.mode() & 0o7777, 0o4755, "mode of {}", f.display());
        assert_eq!(after.nlink(), 2, "{}: its two names and none in the store", f.display());
        assert_eq!(after.mtime(), before.mtime());
        assert_eq!(fs::read(&f).unwrap(), data);
        assert_eq!(
            fs::symlink_metadata(upper.join("data/suid-link")).unwrap().ino(),
            after.ino(),
            "its second name is still the same file"
        );
        assert_eq!(xattr_value(&f, "security.capability").as_deref(), Some(cap_raw));
        let dir = upper.parent().unwrap();
        assert!(!dir.join("undo").exists() && !dir.join("layer").exists());
        let mut objects = Vec::new();
        for fan in fs::read_dir(&rig.store).unwrap().flatten() {
            if fan.file_name().len() == 2 {
                for o in fs::read_dir(fan.path()).unwrap().flatten() {
                    objects.push(o.metadata().unwrap().ino());
                }
            }
        }
        assert!(
            !objects.contains(&after.ino()),
            "the snapshot's file is still a store object"
        );
        // Issue 43: what the failed Commit stored is collected as a
        // Remove's objects are (after --gc-delay), but for what an image
        // still names.
        let object = |p: &Path| {
            let out = String::from_utf8_lossy(&tilefs(&[os("digest"), p.as_os_str()]).stdout).into_owned();
            let hex = out
                .split_whitespace()
                .next()
                .unwrap()
                .trim_start_matches("sha256:")
                .to_string();
            rig.store.join(&hex[..2]).join(&hex[2..])
        };
        let (suid, dup) = (object(&f), object(&upper.join("data/dup")));
        let log = rig.area.join("snapshotter.log");
        let collected = || {
            let text = fs::read_to_string(&log).unwrap_or_default();
            text.lines()
                .filter_map(|l| l.split_once(": collected ")?.1.split(' ').next()?.parse::<u64>().ok())
                .sum::<u64>()
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while collected() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(collected() > 0, "nothing collected after the failed Commit");
        assert!(!suid.exists(), "{} left after the failed Commit", suid.display());
        assert!(dup.exists(), "{}, which an image names, was collected", dup.display());
    }

    // The store writable again, the next mount stores the layer: the file
    // as it was, in the image.
    rig.view("v1", "done").unwrap();
    mount_snapshot(&rig, "v1", &v);
    let m1 = fs::symlink_metadata(v.join("data/suid")).unwrap();
    assert_eq!((m1.uid(), m1.gid(), m1.mode() & 0o7777), (1000, 1000, 0o4755));
    assert_eq!(fs::read(v.join("data/suid")).unwrap(), data);
    assert_eq!(
        xattr_value(&v.join("data/suid"), "security.capability").as_deref(),
        Some(cap_raw)
    );
    umount(&v);
    ok(rig.snapshots().args(["rm", "v1"]));

    // Directories renamed through the overlay (redirects in the upper
    // directory): a rename in place, one into another directory, a
    // renamed file, a removal and a new file in a renamed directory, a
    // mode changed (metacopy).
    ok(rig.snapshots().args(["prepare", "ren", "done"]));
    mount_snapshot(&rig, "ren", &m);
    ok(Command::new("sh").current_dir(&m).args([
        "-c",
        "set -e; mv data moved; mkdir moved/sub; echo fresh > moved/sub/new; rm moved/own-0; \
         mv opaque moved/sub/op; mv moved/suid moved/suid-renamed; chmod 600 moved/shared-2; \
         mkdir -p etc/deep/er; mv etc/deep etc/deeper",
    ]));
    let want = tree_of(&m);
    assert!(
        want.contains_key("moved/sub/op/new") && !want.contains_key("data"),
        "{want:?}"
    );
    umount(&m);
    let upper = upper_holding(&rig, "moved");
    assert!(
        xattr_value(&upper.join("moved"), "trusted.overlay.redirect").is_some(),
        "overlayfs recorded no redirect: the test tests nothing"
    );
    ok(rig.snapshots().args(["commit", "renamed", "ren"]));
    rig.view("v2", "renamed").unwrap();
    mount_snapshot(&rig, "v2", &v);
    let got = tree_of(&v);
    umount(&v);
    assert_eq!(got, want, "the committed snapshot shows the tree the active one showed");
    // And a chain above it still sees it.
    ok(rig.snapshots().args(["prepare", "above", "renamed"]));
    mount_snapshot(&rig, "above", &m);
    assert_eq!(fs::read(m.join("moved/sub/new")).unwrap(), b"fresh\n");
    umount(&m);
    for k in ["above", "v2"] {
        ok(rig.snapshots().args(["rm", k]));
    }
    drop(rig);
}

/// A tar whose names and link targets are written as given (the tar
/// writer refuses those that escape): (name, type, link target, bytes).
fn raw_tar(entries: &[(&str, tar::EntryType, &str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, kind, link, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_mode(match kind {
            tar::EntryType::Directory => 0o755,
            tar::EntryType::Symlink => 0o777,
            _ => 0o644,
        });
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(data.len() as u64);
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

/// An image of uncompressed `layers` in an OCI layout, pushed with skopeo.
fn push_raw_image(area: &Area, registry: &Registry, name: &str, layers: &[Vec<u8>]) -> String {
    let layout = area.dir(&format!("layout-{name}"));
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| {
        let hex = sha256_hex(data);
        fs::write(blobs.join(&hex), data).unwrap();
        (format!("sha256:{hex}"), data.len())
    };
    let descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|l| {
            let (d, n) = put(l);
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": n})
        })
        .collect();
    let diff_ids: Vec<String> = layers.iter().map(|l| format!("sha256:{}", sha256_hex(l))).collect();
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let (cd, cn) = put(config.to_string().as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
        "layers": descs,
    });
    let (md, mn) = put(manifest.to_string().as_bytes());
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
        "annotations": {"org.opencontainers.image.ref.name": name},
    }]});
    fs::write(layout.join("index.json"), index.to_string()).unwrap();
    fs::write(layout.join("oci-layout"), r#"{"imageLayoutVersion": "1.0.0"}"#).unwrap();
    let remote = format!("{}/tilefs/{name}:v1", registry.addr);
    ok(Command::new("skopeo").args([
        "copy",
        "-q",
        "--dest-tls-verify=false",
        &format!("oci:{}:{name}", layout.display()),
        &format!("docker://{remote}"),
    ]));
    remote
}

#[test]
fn hostile_layers_write_nothing_outside_and_read_nothing_outside() {
    use std::os::unix::fs::MetadataExt;
    use tar::EntryType as T;
    require_tools();
    let area = Area::new();
    let rig = Rig::start(&area);
    // A directory outside every snapshot, with a secret the layers try to
    // reach by hardlink (a link would move it into the store at Commit).
    let outside = area.dir("outside");
    let secret = Rng::new(4242).bytes(8 << 10);
    fs::write(outside.join("secret"), &secret).unwrap();
    let out_abs = outside.display().to_string();
    let up = "../".repeat(12);
    let out_rel = format!("{up}{}", out_abs.trim_start_matches('/'));
    let l1 = raw_tar(&[
        ("etc/", T::Directory, "", b""),
        ("etc/abs", T::Symlink, &out_abs, b""),
        ("etc/rel", T::Symlink, &out_rel, b""),
        (
            &format!("{out_rel}/dotdot"),
            T::Regular,
            "",
            b"written through .. names",
        ),
    ]);
    let l2 = raw_tar(&[
        (
            "etc/abs/through-abs",
            T::Regular,
            "",
            b"written through an absolute symlink",
        ),
        (
            "etc/rel/through-rel",
            T::Regular,
            "",
            b"written through a relative symlink",
        ),
    ]);
    let l3 = raw_tar(&[("hl-abs", T::Link, &format!("{out_abs}/secret"), b"")]);
    let l4 = raw_tar(&[("hl-rel", T::Link, &format!("{out_rel}/secret"), b"")]);
    let images = [
        push_raw_image(&area, rig.registry(), "through-links", &[l1.clone(), l2.clone()]),
        push_raw_image(&area, rig.registry(), "hardlink-abs", &[l1.clone(), l2.clone(), l3]),
        push_raw_image(&area, rig.registry(), "hardlink-rel", &[l1, l2, l4]),
    ];
    // containerd's differ decides whether it applies them; whatever it
    // does, nothing lands outside and nothing outside enters the store.
    let mut pulled = Vec::new();
    for image in &images {
        let out = run(rig
            .ctr()
            .args(["images", "pull", "--plain-http", "--snapshotter", "tilefs", image]));
        eprintln!("pull of {image}: {}: {}", out.status, stderr(&out));
        pulled.push(out.status.success());
    }
    let names: Vec<_> = fs::read_dir(&outside)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, ["secret"], "something was written outside the snapshots");
    let m = fs::symlink_metadata(outside.join("secret")).unwrap();
    assert_eq!(
        (m.nlink(), m.uid(), m.mode() & 0o7777),
        (1, 0, 0o644),
        "the secret was linked or changed"
    );
    assert_eq!(fs::read(outside.join("secret")).unwrap(), secret);
    let secret_hex = sha256_hex(&secret);
    for fan in fs::read_dir(&rig.store).unwrap().flatten() {
        if fan.file_name().len() == 2 {
            for o in fs::read_dir(fan.path()).unwrap().flatten() {
                assert_ne!(
                    sha256_hex(&fs::read(o.path()).unwrap()),
                    secret_hex,
                    "the secret is in the store"
                );
            }
        }
    }
    // An image applied is one of ordinary snapshots, its names inside it
    // (read from the chains' images: a view here could race containerd's
    // gc after the failed pulls).
    assert!(pulled[0], "the image of symlinks and .. names was refused");
    rig.settle();
    let dumps: Vec<String> = held_images(&rig.store)
        .iter()
        .map(|t| ok(Command::new(tilefs_bin()).arg("dump").arg(t)))
        .collect();
    // containerd's differ keeps `..` names and paths through symlinks in
    // the snapshot (it resolves them in the upper directory, which has no
    // symlink: a directory is made there).
    let inside = [
        format!("/{}/dotdot ", out_abs.trim_start_matches('/')),
        "/etc/abs/through-abs ".into(),
        "/etc/rel/through-rel ".into(),
    ];
    assert!(
        dumps
            .iter()
            .any(|d| inside.iter().all(|p| d.lines().any(|l| l.starts_with(p.as_str())))),
        "no chain holds {inside:?}: {dumps:#?}"
    );

    // A snapshotter gone for good (its state removed) leaves its images
    // held: fsck names them, gc keeps them, `untag --orphaned` lets them go.
    let mut rig = rig;
    rig.stop_snapshotter("-TERM");
    let held = held_images(&rig.store);
    assert!(!held.is_empty());
    fs::rename(rig.root.join("metadata"), rig.root.join("metadata.gone")).unwrap();
    let store = rig.store.clone();
    let tilefs_in = |args: &[&str]| ok(Command::new(tilefs_bin()).args(args).arg("--store").arg(&store));
    let fsck = tilefs_in(&["fsck"]);
    assert!(
        fsck.contains(&format!(
            "held by the containerd snapshotter at {}, which is gone",
            rig.root.display()
        )) && fsck.contains("tilefs untag --orphaned"),
        "{fsck}"
    );
    let objects = objects_in(&store);
    tilefs_in(&["gc"]);
    assert_eq!(objects_in(&store), objects, "gc collected what an orphaned image holds");
    let out = run(Command::new(tilefs_bin())
        .args(["untag", "--orphaned", "--store"])
        .arg(&store));
    assert!(
        out.status.success() && stderr(&out).contains("which is gone"),
        "{}",
        stderr(&out)
    );
    assert!(held_images(&store).is_empty());
    tilefs_in(&["gc"]);
    assert_eq!(objects_in(&store), 0);
    drop(rig);
}

/// Issue 43: `ctr snapshots commit` of a running container's snapshot. The
/// container holds a file open for writing and writes on after the
/// Commit: the objects the Commit stored never change (fsck finds them
/// whole, a view of the committed snapshot shows the bytes of the
/// Commit), and the container keeps its upper directory (it creates files
/// in `/` after), as under containerd's overlayfs snapshotter.
#[test]
fn committing_a_running_container_copies_and_leaves_it_working() {
    require_tools();
    let area = Area::new();
    let mut rig = Rig::start(&area);
    let a = push_image(&area, rig.registry(), "a", &[&|r: &Path| base_layer(r, 1, 5000, 1)]);
    rig.pull(&a);
    rig.settle();
    // 2000 lines (some 20 KB: an object), then fd 3 kept open for append
    // by the container's process for its whole life.
    let script = "i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done > /data/log; \
                  exec 3>>/data/log; echo > /ready; exec sleep 1000";
    ok(rig.ctr().args([
        "run",
        "-d",
        "--snapshotter",
        "tilefs",
        &a,
        "live",
        "/bin/sh",
        "-c",
        script,
    ]));
    let exec = |n: &str, cmd: &str| {
        run(rig
            .ctr()
            .args(["tasks", "exec", "--exec-id", n, "live", "/bin/sh", "-c", cmd]))
    };
    let t = Instant::now();
    while !exec("wait", "test -e /ready").status.success() {
        assert!(t.elapsed() < Duration::from_secs(20), "the container did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let original: String = (0..2000).map(|i| format!("line-{i}\n")).collect();
    ok(rig.snapshots().args(["commit", "frozen", "live"]));
    rig.settle();
    // The container writes on, through its open descriptor and by name.
    let out = exec(
        "write",
        "echo through-fd >> /proc/1/fd/3 && echo by-name >> /data/log && md5sum /data/log",
    );
    assert!(
        out.status.success(),
        "the container cannot write after the Commit: {}",
        stderr(&out)
    );
    let mut now = original.clone();
    now.push_str("through-fd\nby-name\n");
    let want = {
        let p = area.path("now");
        fs::write(&p, &now).unwrap();
        ok(Command::new("md5sum").arg(&p))
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(text.trim(), format!("{want}  /data/log"));
    // The store: no object changed.
    let fsck = run(Command::new(tilefs_bin()).args(["fsck", "--store"]).arg(&rig.store));
    assert!(
        fsck.status.success(),
        "fsck after the container wrote on: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        stderr(&fsck)
    );
    // The committed snapshot shows the file as it was at the Commit.
    rig.view("look", "frozen").unwrap();
    let mnt = area.dir("look");
    mount_snapshot(&rig, "look", &mnt);
    let seen = fs::read_to_string(mnt.join("data/log"));
    let ready = mnt.join("ready").exists();
    umount(&mnt);
    assert_eq!(
        seen.unwrap(),
        original,
        "the committed snapshot's file changed after the Commit"
    );
    assert!(ready, "the committed snapshot lacks /ready");
    // Its upper directory is still its own: it makes files in `/`.
    let out = exec("create", "echo new > /made-after && cat /made-after");
    assert!(
        out.status.success(),
        "the container cannot create a file after the Commit: {}",
        stderr(&out)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "new\n");
    // An unpack's files were moved; the running container's copied.
    let log = fs::read_to_string(area.path("snapshotter.log")).unwrap();
    assert!(log.contains("stored in") && log.contains("(moved)"), "{log}");
    assert!(
        log.contains("(copied: a live overlay has its upper directory)"),
        "{log}"
    );
    // Once the container is gone, so is its upper directory (here at the
    // snapshotter's next start).
    ok(rig.ctr().args(["tasks", "kill", "-s", "SIGKILL", "live"]));
    let t = Instant::now();
    while !run(rig.ctr().args(["tasks", "delete", "live"])).status.success() {
        assert!(t.elapsed() < Duration::from_secs(20), "the task did not stop");
        std::thread::sleep(Duration::from_millis(100));
    }
    let snapshots = rig.root.join("snapshots");
    let kept = || {
        fs::read_dir(&snapshots)
            .unwrap()
            .flatten()
            .any(|e| e.path().join("fs/made-after").exists())
    };
    assert!(kept(), "the container's upper directory went while it ran");
    rig.stop_snapshotter("-TERM");
    rig.start_snapshotter();
    assert!(!kept(), "the upper directory of a container that is gone stays");
    drop(rig);
}

/// Issue 43: the snapshotter says at each start, as `tilefs fsck` does,
/// that a store others can read gives them every file of every image.
#[test]
fn the_snapshotter_warns_at_start_about_a_store_others_can_read() {
    use std::os::unix::fs::PermissionsExt;
    assert!(is_root(), "the containerd tests run as root");
    let area = Area::new();
    let (root, store, sock, log) = (
        area.path("snaproot"),
        area.path("store"),
        area.path("s.sock"),
        area.path("snapshotter.log"),
    );
    let mut child = Some(spawn_snapshotter(&root, &store, &sock, &[], &log));
    stop_child(&mut child, "-TERM");
    assert!(
        !fs::read_to_string(&log).unwrap().contains("warning"),
        "a store made is root's alone"
    );
    fs::set_permissions(&store, fs::Permissions::from_mode(0o755)).unwrap();
    let mut child = Some(spawn_snapshotter(&root, &store, &sock, &[], &log));
    stop_child(&mut child, "-TERM");
    let text = fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(": warning:") && text.contains("every local user can read"),
        "{text}"
    );
}

/// The names below `root` (not followed), `/`-joined, sorted.
fn names_below(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.symlink_metadata().unwrap().is_dir() {
                stack.push(p.clone());
            }
            out.push(p.strip_prefix(root).unwrap().display().to_string());
        }
    }
    out.sort();
    out
}

/// Issue 43: an opaque marker of the root (`./.wh..wh..opq`,
/// `.wh..wh..opq`) means the same in `tilefs pull`, in the snapshotter and
/// in containerd's own overlayfs snapshotter on the kernel: nothing is
/// hidden (overlayfs ignores an opaque layer root).
#[test]
fn an_opaque_root_means_the_same_to_pull_the_snapshotter_and_containerd() {
    use tar::EntryType as T;
    require_tools();
    let area = Area::new();
    let rig = Rig::start(&area);
    let image = push_raw_image(
        &area,
        rig.registry(),
        "opaque-root",
        &[
            raw_tar(&[
                ("etc/", T::Directory, "", b""),
                ("etc/a", T::Regular, "", b"below"),
                ("keep", T::Regular, "", b"kept"),
            ]),
            raw_tar(&[
                ("./.wh..wh..opq", T::Regular, "", b""),
                ("./new2", T::Regular, "", b"2"),
            ]),
            raw_tar(&[(".wh..wh..opq", T::Regular, "", b""), ("new3", T::Regular, "", b"3")]),
        ],
    );
    // What a container sees, on each snapshotter: a view of the chain.
    let seen_by = |snapshotter: &str| -> Vec<String> {
        ok(rig
            .ctr()
            .args(["images", "pull", "--plain-http", "--snapshotter", snapshotter, &image]));
        let mut snaps = rig.ctr();
        snaps.args(["snapshots", "--snapshotter", snapshotter]);
        let list = ok(Command::new(snaps.get_program()).args(snaps.get_args()).arg("ls"));
        let rows: Vec<Vec<&str>> = list.lines().skip(1).map(|l| l.split_whitespace().collect()).collect();
        let top = rows
            .iter()
            .filter(|r| r.last() == Some(&"Committed"))
            .map(|r| r[0])
            .find(|k| !rows.iter().any(|r| r.len() == 3 && r[1] == *k))
            .unwrap_or_else(|| panic!("no top snapshot: {list}"));
        let key = format!("view-{snapshotter}");
        view_kept(&snaps, &key, top).unwrap();
        let mnt = area.dir(&key);
        let cmd = ok(Command::new(snaps.get_program())
            .args(snaps.get_args())
            .arg("mounts")
            .arg(&mnt)
            .arg(&key));
        ok(Command::new("sh").args(["-c", cmd.trim()]));
        let names = names_below(&mnt);
        umount(&mnt);
        names
    };
    let want = ["etc", "etc/a", "keep", "new2", "new3"];
    assert_eq!(seen_by("overlayfs"), want, "containerd's overlayfs snapshotter");
    assert_eq!(seen_by("tilefs"), want, "the tilefs snapshotter");
    let pulled = area.dir("pulled");
    common::oci::pull(&pulled, &format!("docker://{image}"), &["--tag", "x"]);
    let dump = ok(Command::new(tilefs_bin()).arg("dump").arg(pulled.join("images/x")));
    let mut names: Vec<String> = dump
        .lines()
        .filter_map(|l| l.split(' ').next())
        .filter(|p| *p != "/")
        .map(|p| p.trim_start_matches('/').to_string())
        .collect();
    names.sort();
    assert_eq!(names, want, "tilefs pull");
    drop(rig);
}

/// `tilefs pull --containerd ADDRESS --namespace NS ARGS... REF` (plain
/// HTTP), with the signature policy `policy`.
fn pull_into(rig: &Rig, policy: &Path, args: &[&str], reference: &str) -> Output {
    run(Command::new(tilefs_bin())
        .args(["pull", "--json", "--tls-verify=false", "--containerd"])
        .arg(&rig.sock)
        .args(["--namespace", &rig.ns, "--signature-policy"])
        .arg(policy)
        .args(args)
        .arg(format!("docker://{reference}")))
}

/// `ctr` users start an ordinary image with a tilefs index lazily through
/// `tilefs pull --containerd`; an image without one is unpacked whole and
/// runs too; the pull is judged by tilefs's policy; removing the images
/// lets containerd's gc remove their snapshots; mistakes are named.
#[test]
fn tilefs_pull_into_containerd_starts_ctr_containers_lazily() {
    require_tools();
    let area = Area::new();
    let rig = Rig::start(&area);
    let policy = area.path("policy.json");
    fs::write(&policy, r#"{"default": [{"type": "insecureAcceptAnything"}]}"#).unwrap();
    // busybox, 24 files of 256 KiB (a gzip checkpoint about every 4 MiB),
    // and an 8 MiB file alone.
    let indexed = push_image(
        &area,
        rig.registry(),
        "indexed",
        &[
            &|r: &Path| {
                common::oci::busybox_into(r, &["sh", "cat", "echo", "md5sum"]);
                fs::create_dir_all(r.join("etc")).unwrap();
                fs::write(r.join("etc/msg"), "hello through ctr").unwrap();
            },
            &|r: &Path| {
                let files: Vec<(String, usize)> = (0..24).map(|i| (format!("data/f{i}"), 256 << 10)).collect();
                common::oci::write_files(r, 41, &files);
            },
            &|r: &Path| common::oci::write_files(r, 42, &[("big/lone".to_string(), 8 << 20)]),
        ],
    );
    ok(Command::new(tilefs_bin())
        .args(["index", "-q", "--tls-verify=false", "--store"])
        .arg(area.path("indexing"))
        .arg(format!("docker://{indexed}")));
    let raw = common::oci::skopeo_raw(&format!("docker://{indexed}"));
    let layers: Vec<(String, u64)> = raw["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["digest"].as_str().unwrap().to_string(), l["size"].as_u64().unwrap()))
        .collect();
    let layer_gets = |from: usize| -> Vec<(String, u16, u64)> {
        rig.registry().requests()[from..]
            .iter()
            .filter(|r| r.method == "GET")
            .filter_map(|r| {
                let l = layers.iter().find(|l| r.path.ends_with(&l.0))?;
                Some((l.0.clone(), r.status, r.bytes))
            })
            .collect()
    };

    // The pull: every layer a lazy snapshot, no layer blob fetched.
    let from = rig.registry().requests().len();
    let t = Instant::now();
    let out = pull_into(&rig, &policy, &[], &indexed);
    assert!(out.status.success(), "{}", stderr(&out));
    let pulled = t.elapsed();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!(
        "tilefs pull --containerd of the indexed image ({:.2} s): {report}",
        pulled.as_secs_f64()
    );
    assert_eq!(report["name"], indexed.as_str());
    assert_eq!(report["layers"], 3);
    assert_eq!(report["lazy_layers"], 3, "{report}");
    assert_eq!(report["blob_bytes"], 0);
    assert!(
        report["lazy"]
            .as_str()
            .unwrap()
            .starts_with("lazy: through tilefs index"),
        "{report}"
    );
    assert_eq!(layer_gets(from), [], "the pull fetched layer blobs");
    let listed = ok(rig.ctr().args(["images", "ls", "-q"]));
    assert!(listed.lines().any(|l| l == indexed), "ctr images ls: {listed}");
    // Its lease ended: the image holds what it needs.
    assert_eq!(ok(rig.ctr().args(["leases", "ls", "-q"])), "", "a lease was left");

    // ctr runs it: a file of the data layer is fetched by range, from the
    // checkpoint before it; the big file's layer is not fetched.
    let from = rig.registry().requests().len();
    let t = Instant::now();
    let out = rig.run_in(&indexed, "lazy-indexed", "cat /etc/msg; echo; md5sum /data/f9");
    eprintln!("ctr run of the lazily pulled image: {:.2} s", t.elapsed().as_secs_f64());
    let md5 = ok(Command::new("md5sum").arg(area.path("bundle-indexed/rootfs/data/f9")));
    assert!(out.starts_with("hello through ctr\n"), "{out}");
    assert!(out.contains(md5.split_whitespace().next().unwrap()), "{out}");
    let gets = layer_gets(from);
    let (data, data_size) = &layers[1];
    let fetched: u64 = gets.iter().filter(|g| &g.0 == data).map(|g| g.2).sum();
    eprintln!("ctr run: layer blob GETs {gets:?}; {fetched} of the data layer's {data_size} bytes");
    assert!(
        fetched > 0 && fetched * 2 < *data_size,
        "{fetched} bytes of a layer of {data_size}"
    );
    // (busybox's layer, shorter than a checkpoint's span, is fetched whole
    // on first use.)
    assert!(
        gets.iter().filter(|g| &g.0 == data).all(|g| g.1 == 206),
        "whole-blob GETs of the data layer: {gets:?}"
    );
    assert!(
        gets.iter().all(|g| g.0 != layers[2].0),
        "the big file's layer was fetched: {gets:?}"
    );

    // Without an index: the layers are fetched into containerd's content
    // store and unpacked by containerd, and the image runs.
    let plain = push_image(
        &area,
        rig.registry(),
        "plain",
        &[&|r: &Path| {
            common::oci::busybox_into(r, &["sh", "cat"]);
            fs::create_dir_all(r.join("etc")).unwrap();
            fs::write(r.join("etc/msg"), "hello unindexed").unwrap();
        }],
    );
    let out = pull_into(&rig, &policy, &[], &plain);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("tilefs pull --containerd of an unindexed image: {report}");
    assert_eq!(
        (report["lazy_layers"].as_u64(), report["unpacked_layers"].as_u64()),
        (Some(0), Some(1))
    );
    assert!(report["blob_bytes"].as_u64().unwrap() > 0);
    let said = report["lazy"].as_str().unwrap();
    assert!(
        said.starts_with("pulled whole:") && said.contains("has no tilefs index"),
        "{said}"
    );
    assert_eq!(rig.run_in(&plain, "whole-plain", "cat /etc/msg"), "hello unindexed");
    // Again: containerd has every layer, nothing is fetched.
    let out = pull_into(&rig, &policy, &[], &plain);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["present_layers"].as_u64(), report["blob_bytes"].as_u64()),
        (Some(1), Some(0)),
        "{report}"
    );

    // tilefs's policy judges the pull: refused, nothing is made.
    let refusing = area.path("refusing.json");
    fs::write(&refusing, r#"{"default": [{"type": "reject"}]}"#).unwrap();
    let other = push_image(
        &area,
        rig.registry(),
        "refused",
        &[&|r: &Path| common::oci::busybox_into(r, &["sh"])],
    );
    let out = pull_into(&rig, &refusing, &[], &other);
    eprintln!("a pull the policy refuses: {}", stderr(&out).trim());
    assert!(
        !out.status.success() && stderr(&out).contains("reject"),
        "{}",
        stderr(&out)
    );
    assert!(!ok(rig.ctr().args(["images", "ls", "-q"])).contains("refused"));

    // Mistakes are named, with the fix.
    let out = pull_into(&rig, &policy, &["--snapshotter", "nosuch"], &plain);
    eprintln!("no such snapshotter: {}", stderr(&out).trim());
    assert!(
        !out.status.success()
            && stderr(&out).contains("no snapshotter \"nosuch\"")
            && stderr(&out).contains("proxy_plugins"),
        "{}",
        stderr(&out)
    );
    let out = run(Command::new(tilefs_bin())
        .args(["pull", "--containerd"])
        .arg(area.path("nothing.sock"))
        .arg(format!("docker://{plain}")));
    eprintln!("no containerd: {}", stderr(&out).trim());
    assert!(
        !out.status.success() && stderr(&out).contains("cannot reach containerd at"),
        "{}",
        stderr(&out)
    );

    // Removing the images lets containerd's gc remove every snapshot (the
    // lazy ones' FUSE servers end).
    ok(rig.ctr().args(["images", "rm", "--sync", &indexed, &plain]));
    let t = Instant::now();
    loop {
        let left = ok(rig.snapshots().arg("ls"));
        if left.lines().count() <= 1 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "snapshots left after ctr images rm: {left}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mounted: Vec<String> = mountinfo_lines()
        .into_iter()
        .filter(|l| l.contains(&rig.root.display().to_string()))
        .collect();
    assert_eq!(
        mounted,
        Vec::<String>::new(),
        "mounts left under the snapshotter's root"
    );

    // The snapshotter is down: said so, with the fix.
    let mut rig = rig;
    rig.stop_snapshotter("-TERM");
    let out = pull_into(&rig, &policy, &[], &plain);
    eprintln!("the snapshotter down: {}", stderr(&out).trim());
    assert!(
        !out.status.success() && stderr(&out).contains("containerd cannot reach its snapshotter \"tilefs\""),
        "{}",
        stderr(&out)
    );
}
