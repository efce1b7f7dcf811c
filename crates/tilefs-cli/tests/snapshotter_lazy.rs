//! CRI's lazy path, spoken to the snapshotter directly over its gRPC API
//! (as containerd's unpacker speaks it, and as a client that lies would):
//! a runnable tilefs artifact in a real registry becomes committed
//! snapshots without a download, read on demand through FUSE (with
//! --lazy-fuse, as where the kernel cannot fill objects) or through the
//! kernel, objects filled on first access; labels that lie about a digest
//! or a chain make nothing lazily.

mod common;

use common::registry::{Pass, Registry, Relay};
use common::snapshotter::{fstype_below, kernel_served, mount_all, mount_overlay, Snap, TARGET};
use common::*;
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tonic::Code;

const IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
const MANIFEST: &str = "containerd.io/snapshot/cri.manifest-digest";
const LAYER: &str = "containerd.io/snapshot/cri.layer-digest";

/// A command that must succeed; its stdout.
use common::oci::checked as ok;

fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(prev) => format!("sha256:{}", sha256_hex(format!("{prev} {d}").as_bytes())),
        };
        out.push(next);
    }
    out
}

#[test]
fn cri_labels_make_lazy_snapshots_only_when_the_artifact_says_the_same() {
    require(not_root("the snapshotter mounts"));
    require(cannot_fuse());
    for (p, pkg) in [
        ("docker-registry", "docker-registry"),
        ("skopeo", "skopeo"),
        ("umoci", "umoci"),
    ] {
        require(missing_program(p, pkg));
    }
    let area = Area::new();
    let base = area.path("");
    let registry = Registry::start(&area);
    let reg = &registry.addr;

    // An ordinary image, and a runnable tilefs artifact made from it.
    let src = area.dir("src");
    fs::create_dir_all(src.join("etc")).unwrap();
    fs::write(src.join("etc/msg"), "hello lazily\n").unwrap();
    let mut rng = Rng::new(29);
    for i in 0..40 {
        fs::write(src.join(format!("f{i}")), rng.bytes(200 << 10)).unwrap();
    }
    let lay = format!("{}:app", area.path("layout").display());
    ok(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(area.path("layout")));
    ok(Command::new("umoci").args(["new", "--image", &lay]));
    ok(Command::new("umoci")
        .args(["unpack", "--image", &lay])
        .arg(area.path("bundle")));
    ok(Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(area.path("bundle/rootfs")));
    ok(Command::new("umoci")
        .args(["repack", "--image", &lay])
        .arg(area.path("bundle")));
    let plain = format!("{reg}/app:1");
    ok(Command::new("skopeo").args([
        "copy",
        "-q",
        "--dest-tls-verify=false",
        &format!("oci:{lay}"),
        &format!("docker://{plain}"),
    ]));
    let work = area.path("work-store");
    let t = |args: &[&str]| {
        let mut c = Command::new(tilefs_bin());
        c.args(args).arg("--store").arg(&work);
        ok(&mut c)
    };
    t(&[
        "pull",
        "-q",
        "--tls-verify=false",
        "--tag",
        "app",
        &format!("docker://{plain}"),
    ]);
    let lazy_ref = format!("{reg}/app:lazy");
    let out = t(&[
        "push",
        "-q",
        "--tls-verify=false",
        "--runnable-from",
        &format!("docker://{plain}"),
        "app",
        &format!("docker://{lazy_ref}"),
    ]);
    let manifest = out.lines().last().unwrap().to_string();
    let raw = common::oci::skopeo_raw(&format!("docker://{lazy_ref}"));
    let layers: Vec<String> = raw["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect();
    let pack = layers.last().unwrap().clone();
    let pack_size = raw["layers"].as_array().unwrap().last().unwrap()["size"]
        .as_u64()
        .unwrap();
    let chain = chain_ids(&layers);
    let plain_raw = common::oci::skopeo_raw(&format!("docker://{plain}"));
    let plain_manifest = format!(
        "sha256:{}",
        sha256_hex(
            &Command::new("skopeo")
                .args(["inspect", "--raw", "--tls-verify=false", &format!("docker://{plain}")])
                .output()
                .unwrap()
                .stdout
        )
    );
    let plain_layer = plain_raw["layers"][0]["digest"].as_str().unwrap().to_string();
    let labels = |target: &str, manifest: &str, layer: &str| -> HashMap<String, String> {
        [
            (TARGET, target),
            (IMAGE_REF, lazy_ref.as_str()),
            (MANIFEST, manifest),
            (LAYER, layer),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    };

    // The FUSE path (kernel_filled_lazy_* below: the kernel's).
    let mut snap = Snap::start_with(&base, &["--lazy-fuse"]);
    let before = registry.requests().len();

    // Only root speaks to it: it mounts, and fetches with root's
    // credentials. Another user who can reach the socket (the area made
    // traversable) is refused by its mode (13: EACCES from connect).
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&base, fs::Permissions::from_mode(0o711)).unwrap();
        let mode = fs::metadata(&snap.sock).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the socket's mode");
        // Its mounts (images' setuid files among them) are out of reach.
        let mode = fs::metadata(base.join("root")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "the snapshotter's root's mode");
        let st = as_nobody(Command::new("/usr/bin/python3").args([
            "-c",
            "import socket, sys\n\
             s = socket.socket(socket.AF_UNIX)\n\
             try:\n    s.connect(sys.argv[1])\n\
             except PermissionError:\n    sys.exit(13)\n\
             except OSError as e:\n    print(e)\n    sys.exit(1)",
        ]))
        .arg(&snap.sock)
        .status()
        .unwrap();
        assert_eq!(st.code(), Some(13), "uid 65534 connecting to the snapshotter's socket");
    }

    // Lies: a layer of another position, a chain ID of nothing, a parent
    // that is not the layer below, an ordinary image. Each Prepare is an
    // ordinary one (an active snapshot for containerd to unpack into), and
    // no snapshot of the claimed name appears.
    let bogus = format!("sha256:{}", "e".repeat(64));
    for (i, (target, man, layer, parent)) in [
        (chain[0].as_str(), manifest.as_str(), layers[1].as_str(), ""),
        (bogus.as_str(), manifest.as_str(), layers[0].as_str(), ""),
        (chain[1].as_str(), manifest.as_str(), layers[1].as_str(), ""),
        (chain[0].as_str(), plain_manifest.as_str(), plain_layer.as_str(), ""),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("k8s.io/1/extract-lie{i}");
        let got = snap.prepare(&key, parent, labels(target, man, layer));
        assert!(got.is_ok(), "lie {i}: {got:?}\n{}", snap.log());
        assert_eq!(snap.walk(target, parent), None, "lie {i} made {target}");
        snap.remove(&key);
    }
    assert!(snap.log().contains("not served lazily"), "{}", snap.log());
    assert!(snap.log().contains("unit-sandbox: applied"), "{}", snap.log());

    // The truth: every layer is committed at once, AlreadyExists, and
    // found as containerd finds it (by its chain ID label and parent).
    let mut names: Vec<String> = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        let parent = names.last().cloned().unwrap_or_default();
        let got = snap.prepare(
            &format!("k8s.io/2/extract-{i}"),
            &parent,
            labels(&chain[i], &manifest, layer),
        );
        assert_eq!(
            got.as_ref().map_err(|e| e.0),
            Err(Code::AlreadyExists),
            "layer {i}: {got:?}\n{}",
            snap.log()
        );
        let name = snap.walk(&chain[i], &parent).expect("the lazy snapshot");
        let (kind, l) = snap.stat(&name).unwrap();
        assert_eq!(kind, 3, "committed"); // containerd's KindCommitted
        assert_eq!(l.get(TARGET), Some(&chain[i]));
        names.push(name);
    }
    let top = names.last().unwrap();
    let fetched = |from: usize| -> u64 {
        registry.requests()[from..]
            .iter()
            .filter(|r| r.method == "GET" && r.path.ends_with(&pack))
            .map(|r| r.bytes)
            .sum()
    };
    assert_eq!(fetched(before), 0, "the pack was downloaded before any read");

    // A container's view reads through the lazy image: the files read are
    // fetched, and no more.
    // (A view of one lazy image is its FUSE mount, bound read-only.)
    let view = snap.view("k8s.io/3/view", top);
    assert_eq!(view.0, "bind", "{view:?}");
    let v = area.path("v");
    fs::create_dir_all(&v).unwrap();
    ok(Command::new("mount").args(["--bind", "-o", "ro", &view.1]).arg(&v));
    let v = Mounted(v);
    assert!(
        mount_line(&PathBuf::from(&view.1)).is_some_and(|l| l.contains("fuse")),
        "{:?}",
        mount_line(&PathBuf::from(&view.1))
    );
    let start = registry.requests().len();
    assert_eq!(fs::read_to_string(v.0.join("etc/msg")).unwrap(), "hello lazily\n");
    assert_eq!(fs::read(v.0.join("f3")).unwrap(), fs::read(src.join("f3")).unwrap());
    let got = fetched(start);
    assert!(
        got > 0 && got < pack_size / 4,
        "{got} of {pack_size} pack bytes for two files"
    );

    // An active snapshot on it writes above it, and is committed: its
    // upper directory is kept as its layer, stacked over the lazy image
    // by the mounts above it (flattening would fetch the whole image).
    let rw = snap.prepare("k8s.io/4/rw", top, HashMap::new()).unwrap();
    assert!(
        !rw.iter().any(|o| o.contains("::")),
        "a lazy image has no data-only store layer: {rw:?}"
    );
    let m = mount_overlay(&rw, &area.path("rw"));
    fs::write(m.0.join("etc/new"), "mine").unwrap();
    assert_eq!(fs::read(m.0.join("f5")).unwrap(), fs::read(src.join("f5")).unwrap());
    fs::remove_file(m.0.join("f6")).unwrap();
    m.unmount();
    let start = registry.requests().len();
    snap.commit("k8s.io/4/c", "k8s.io/4/rw").unwrap();
    assert_eq!(snap.stat("k8s.io/4/c").unwrap().0, 3, "committed");
    let rw2 = snap.prepare("k8s.io/4/rw2", "k8s.io/4/c", HashMap::new()).unwrap();
    assert!(
        rw2.iter()
            .any(|o| o.strip_prefix("lowerdir=").is_some_and(|l| l.split(':').count() == 2)),
        "the kept layer over the lazy image's mount: {rw2:?}"
    );
    let m = mount_overlay(&rw2, &area.path("rw2"));
    assert_eq!(fs::read_to_string(m.0.join("etc/new")).unwrap(), "mine");
    assert!(!m.0.join("f6").exists(), "the whiteout of the committed layer");
    assert_eq!(fs::read(m.0.join("f8")).unwrap(), fs::read(src.join("f8")).unwrap());
    fs::write(m.0.join("etc/newer"), "mine too").unwrap();
    m.unmount();
    // A layer over a kept one is kept too; a view shows them all.
    snap.commit("k8s.io/4/c2", "k8s.io/4/rw2").unwrap();
    let cv = snap.view("k8s.io/4/cview", "k8s.io/4/c2");
    let m = mount_overlay(&cv.2, &area.path("cview"));
    assert_eq!(fs::read_to_string(m.0.join("etc/new")).unwrap(), "mine");
    assert_eq!(fs::read_to_string(m.0.join("etc/newer")).unwrap(), "mine too");
    assert!(!m.0.join("f6").exists());
    assert_eq!(fs::read_to_string(m.0.join("etc/msg")).unwrap(), "hello lazily\n");
    m.unmount();
    let got = fetched(start);
    assert!(got < pack_size / 4, "{got} of {pack_size} pack bytes for one more file");

    // The snapshotter restarts; the view keeps reading (its FUSE server
    // is a process of its own), and a new Mounts finds the image mounted.
    snap.stop();
    snap.run();
    assert_eq!(fs::read(v.0.join("f7")).unwrap(), fs::read(src.join("f7")).unwrap());
    assert_eq!(snap.mounts("k8s.io/3/view"), view);
    assert_eq!(snap.mounts("k8s.io/4/cview"), cv);
    // (Not `tilefs umount`, which would wait for the server of the FUSE
    // mount this binds.)
    ok(Command::new("umount").arg(&v.0));

    // Removed top down, nothing of it stays mounted.
    for k in ["k8s.io/3/view", "k8s.io/4/cview", "k8s.io/4/c2", "k8s.io/4/c"] {
        snap.remove(k);
    }
    for name in names.iter().rev() {
        snap.remove(name);
    }
    // An artifact whose image the registry now sends corrupt: the labels
    // are true, so the Prepare fails, naming why (containerd could not
    // unpack the layer itself either).
    let erofs = registry.blob_file(&layers[0]);
    let len = fs::metadata(&erofs).unwrap().len() as usize;
    fs::write(&erofs, vec![0x5a; len]).unwrap();
    let e = snap
        .prepare("k8s.io/5/extract-0", "", labels(&chain[0], &manifest, &layers[0]))
        .unwrap_err();
    assert_eq!(e.0, Code::Unavailable, "{e:?}");
    assert!(e.1.contains(&layers[0]) && e.1.contains("does not match"), "{e:?}");
    assert_eq!(snap.walk(&chain[0], ""), None);

    let left: Vec<String> = mountinfo_lines()
        .into_iter()
        .filter(|l| l.contains(&*base.to_string_lossy()))
        .collect();
    assert!(left.is_empty(), "left mounted: {left:?}");
    // The image's FUSE server has exited.
    let server = format!("mount --fuse .*{}", base.join("store").display());
    let t = Instant::now();
    while Command::new("pgrep")
        .args(["-f", &server])
        .output()
        .unwrap()
        .status
        .success()
    {
        assert!(t.elapsed() < Duration::from_secs(10), "{server} is still running");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(snap);
}

/// Issue 44: a layer of an ordinary image with a tilefs index is made
/// lazily over a layer below that containerd unpacked itself (another
/// image's, with the same base): the snapshot, named after that parent so
/// that containerd's walk by parent finds it, shows the whole chain from
/// the index, both layers' files fetched from their blobs on first read.
#[test]
fn an_indexed_layer_is_made_lazily_over_a_layer_containerd_unpacked() {
    require(not_root("the snapshotter mounts"));
    require(cannot_fuse());
    for (p, pkg) in [
        ("docker-registry", "docker-registry"),
        ("skopeo", "skopeo"),
        ("umoci", "umoci"),
    ] {
        require(missing_program(p, pkg));
    }
    let area = Area::new();
    let registry = Registry::start(&area);
    let image = common::oci::push_image_with(
        &area,
        &registry,
        "app",
        &[
            &|r: &Path| common::oci::write_files(r, 41, &[("base/a".to_string(), 300_000)]),
            &|r: &Path| common::oci::write_files(r, 42, &[("top/b".to_string(), 300_000)]),
        ],
        &[],
    );
    let docker = format!("docker://{image}");
    ok(Command::new(tilefs_bin())
        .args(["index", "-q", "--tls-verify=false", "--store"])
        .arg(area.path("indexing"))
        .arg(&docker));
    let raw = common::oci::skopeo_raw(&docker);
    let manifest = format!(
        "sha256:{}",
        sha256_hex(
            &Command::new("skopeo")
                .args(["inspect", "--raw", "--tls-verify=false", &docker])
                .output()
                .unwrap()
                .stdout
        )
    );
    let config: serde_json::Value = serde_json::from_str(&ok(Command::new("skopeo").args([
        "inspect",
        "--config",
        "--raw",
        "--tls-verify=false",
        &docker,
    ])))
    .unwrap();
    let diff_ids: Vec<String> = config["rootfs"]["diff_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect();
    let chain = chain_ids(&diff_ids);
    let top_layer = raw["layers"][1]["digest"].as_str().unwrap().to_string();

    let mut snap = Snap::start(&area.path(""));
    // The base as containerd unpacks a layer with no labels (empty here:
    // its files are not what the lazy snapshot shows).
    let base = format!("k8s.io/2/{}", chain[0]);
    snap.prepare("k8s.io/1/extract-base", "", HashMap::new()).unwrap();
    snap.commit(&base, "k8s.io/1/extract-base").unwrap();
    let labels: HashMap<String, String> = [
        (TARGET, chain[1].as_str()),
        (IMAGE_REF, image.as_str()),
        (MANIFEST, manifest.as_str()),
        (LAYER, top_layer.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let before = registry.requests().len();
    let got = snap.prepare("k8s.io/3/extract-top", &base, labels);
    assert_eq!(
        got.as_ref().map_err(|e| e.0),
        Err(Code::AlreadyExists),
        "{got:?}\n{}",
        snap.log()
    );
    let name = snap
        .walk(&chain[1], &base)
        .unwrap_or_else(|| panic!("the walk finds nothing\n{}", snap.log()));
    assert!(name.ends_with(&format!("/{}/on/{base}", chain[1])), "{name}");
    let blobs = |from: usize| -> usize {
        registry.requests()[from..]
            .iter()
            .filter(|r| r.method == "GET" && r.path.contains("/blobs/") && matches!(r.status, 200 | 206))
            .filter(|r| {
                raw["layers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|l| r.path.ends_with(l["digest"].as_str().unwrap()))
            })
            .count()
    };
    assert_eq!(blobs(before), 0, "a layer blob was fetched before any read");

    // Served by the kernel: the view is an overlay over the image's EROFS
    // mount and the store.
    let view = snap.view_mounts("k8s.io/4/view", &name).unwrap();
    assert!(kernel_served(&view), "{view:?}\n{}", snap.log());
    let v = mount_all(&view, &area.path("v"));
    let bundle = area.path("bundle-app/rootfs");
    for f in ["base/a", "top/b"] {
        assert_eq!(fs::read(v.0.join(f)).unwrap(), fs::read(bundle.join(f)).unwrap(), "{f}");
    }
    assert!(blobs(before) >= 2, "the files came from nowhere");
    drop(v);
    snap.remove("k8s.io/4/view");

    // The base made lazily too: a layer below the top has its image made
    // at its first mount, which may come after a restart.
    let labels: HashMap<String, String> = [
        (TARGET, chain[0].as_str()),
        (IMAGE_REF, image.as_str()),
        (MANIFEST, manifest.as_str()),
        (LAYER, raw["layers"][0]["digest"].as_str().unwrap()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let got = snap.prepare("k8s.io/5/extract-base", "", labels);
    assert_eq!(got.map_err(|e| e.0), Err(Code::AlreadyExists), "{}", snap.log());
    let lower = snap
        .walk(&chain[0], "")
        .unwrap_or_else(|| panic!("the walk finds no lazy base\n{}", snap.log()));
    assert!(
        snap.log().contains("its image made at its first mount"),
        "{}",
        snap.log()
    );
    snap.stop();
    snap.run();
    let view = snap.view_mounts("k8s.io/6/view", &lower).unwrap();
    assert!(kernel_served(&view), "{view:?}");
    let v = mount_all(&view, &area.path("v"));
    assert_eq!(
        fs::read(v.0.join("base/a")).unwrap(),
        fs::read(bundle.join("base/a")).unwrap()
    );
    assert!(!v.0.join("top").exists(), "the base shows the top layer's files");
    drop(v);
    snap.remove("k8s.io/6/view");
}

/// An ordinary image in a registry with a tilefs index, as CRI's labels
/// name its layers: pushed to `registry` and named (in the labels) at
/// `addr`, the registry itself or a relay in front of it.
struct Indexed {
    reference: String,
    manifest: String,
    chain: Vec<String>,
    layers: Vec<String>,
    /// The image's files (its last layer's bundle).
    rootfs: PathBuf,
}

impl Indexed {
    fn push(area: &Area, registry: &Registry, addr: &str, name: &str, layers: &[&dyn Fn(&Path)]) -> Indexed {
        let pushed = common::oci::push_image_with(area, registry, name, layers, &[]);
        let reference = pushed.replacen(&registry.addr, addr, 1);
        let docker = format!("docker://{reference}");
        ok(Command::new(tilefs_bin())
            .args(["index", "-q", "--tls-verify=false", "--store"])
            .arg(area.path("indexing"))
            .arg(&docker));
        let inspect = |more: &[&str]| {
            let out = Command::new("skopeo")
                .args(["inspect", "--raw", "--tls-verify=false"])
                .args(more)
                .arg(&docker)
                .output()
                .unwrap();
            assert!(out.status.success(), "skopeo: {}", String::from_utf8_lossy(&out.stderr));
            out.stdout
        };
        let raw = inspect(&[]);
        let manifest: serde_json::Value = serde_json::from_slice(&raw).unwrap();
        let config: serde_json::Value = serde_json::from_slice(&inspect(&["--config"])).unwrap();
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_str().or_else(|| d["digest"].as_str()).unwrap().to_string())
                .collect()
        };
        Indexed {
            reference,
            manifest: format!("sha256:{}", sha256_hex(&raw)),
            chain: chain_ids(&strings(&config["rootfs"]["diff_ids"])),
            layers: strings(&manifest["layers"]),
            rootfs: area.path(&format!("bundle-{name}/rootfs")),
        }
    }

    /// CRI's labels for layer `i`.
    fn labels(&self, i: usize) -> HashMap<String, String> {
        [
            (TARGET, self.chain[i].as_str()),
            (IMAGE_REF, self.reference.as_str()),
            (MANIFEST, self.manifest.as_str()),
            (LAYER, self.layers[i].as_str()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// Layer `i` made lazily over `parent` by a Prepare with its labels:
    /// the committed snapshot containerd's walk finds.
    fn make_lazily(&self, snap: &Snap, i: usize, parent: &str) -> String {
        let got = snap.prepare(&format!("k8s.io/{i}/extract-{}", self.chain[i]), parent, self.labels(i));
        assert_eq!(got.map_err(|e| e.0), Err(Code::AlreadyExists), "{}", snap.log());
        snap.walk(&self.chain[i], parent)
            .unwrap_or_else(|| panic!("the walk finds nothing\n{}", snap.log()))
    }
}

/// The machine lacks what the kernel's lazy path needs: why.
fn cannot_fill() -> Option<String> {
    not_root("the snapshotter mounts, fanotify pre-content events")
        .or_else(|| cannot_mount("erofs"))
        .or_else(|| cannot_mount("overlay"))
        .or_else(|| missing_program("docker-registry", "docker-registry"))
        .or_else(|| missing_program("skopeo", "skopeo"))
        .or_else(|| missing_program("umoci", "umoci"))
}

/// The processes (pid, parent) of kernel lazy mounts of `store`: their
/// holders and fillers.
fn fillers_of(store: &Path) -> Vec<(u32, u32)> {
    let store = format!("--store\0{}\0", store.display());
    common::filler::processes_naming(&[b"--erofs-alone", store.as_bytes()])
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(20), "{what}: not after 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Issue 45: where the store takes fanotify pre-content marks, a container
/// on a lazily made snapshot is a kernel overlay over the image's EROFS
/// mount and the store, whose placeholders a filler of its own fills on
/// first access. It serves on while the snapshotter restarts; a kill -9 of
/// it fails the reads it had (EIO), never gives a wrong byte, and another
/// takes over.
#[test]
fn kernel_filled_lazy_containers_outlive_a_restart_and_fail_closed() {
    require(cannot_fill());
    let area = Area::new();
    let base = area.path("");
    let registry = Registry::start(&area);
    // Fetches go through a relay, which drips while `slow`: each fill then
    // takes a while, so the kill lands while readers wait.
    let slow = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let relay = Relay::start(&registry.addr, {
        let slow = slow.clone();
        move |_, _| {
            if slow.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
            Pass::All
        }
    });
    let files = std::cell::RefCell::new(Vec::new());
    let img = Indexed::push(
        &area,
        &registry,
        &relay.addr,
        "app",
        &[&|r: &Path| *files.borrow_mut() = common::oci::tree(r, 11, 24, 256 << 10)],
    );
    let files: Vec<String> = files.into_inner().into_iter().map(|f| f.0).collect();
    let mut snap = Snap::start(&base);
    let name = img.make_lazily(&snap, 0, "");
    let mounts = snap.prepare_mounts("k8s.io/9/ctr", &name, HashMap::new()).unwrap();
    assert!(kernel_served(&mounts), "{mounts:?}\n{}", snap.log());
    let root = mount_all(&mounts, &area.path("ctr"));
    let store = base.join("store");
    wait_until("a holder and a filler run", || fillers_of(&store).len() == 2);
    let same = |f: &str| fs::read(root.0.join(f)).unwrap() == fs::read(img.rootfs.join(f)).unwrap();
    assert!(same(&files[0]), "{}", files[0]);
    // A write to a file of the image copies it up whole, filled.
    fs::OpenOptions::new()
        .append(true)
        .open(root.0.join(&files[1]))
        .unwrap();
    let upper = fs::read(root.0.join(&files[1])).unwrap();
    assert!(
        upper == fs::read(img.rootfs.join(&files[1])).unwrap(),
        "copied up wrong"
    );

    // The snapshotter stops: its container reads on; started again, it
    // finds the image mounted.
    snap.stop();
    assert!(same(&files[2]), "{}", files[2]);
    snap.run();
    assert!(same(&files[3]), "{}", files[3]);
    let again = snap.mounts("k8s.io/9/ctr");
    assert_eq!(again.2, mounts[0].options, "{}", snap.log());

    let (holder, filler) = common::filler::holder_and_filler(&fillers_of(&store));
    let rest = &files[4..];
    slow.store(true, std::sync::atomic::Ordering::Relaxed);
    let (right, eio) = common::filler::reads_across_a_kill(&root.0, &img.rootfs, rest, filler);
    eprintln!("during the kill: {right} files read right, {eio} failed with EIO");
    assert!(eio > 0, "the kill came after every read ({right} read)");
    slow.store(false, std::sync::atomic::Ordering::Relaxed);
    wait_until("a new filler runs", || {
        fillers_of(&store)
            .iter()
            .any(|(p, ppid)| *ppid == holder && *p != filler)
    });
    for f in rest {
        assert!(same(f), "{f} after the kill");
    }
    drop(root);
    snap.remove("k8s.io/9/ctr");
    snap.remove(&name);
    // The image unmounted: its holder and filler end.
    wait_until("the holder and filler end", || fillers_of(&store).is_empty());
    drop(relay);
}

/// A store on tmpfs takes no fanotify marks: lazy images are served by
/// FUSE there, and the snapshotter says why, once.
#[test]
fn on_a_store_that_refuses_marks_lazy_images_are_served_by_fuse_saying_why_once() {
    require(cannot_fill());
    require(cannot_fuse());
    let area = Area::new();
    let base = area.path("");
    let store = area.dir("store");
    ok(Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&store));
    let _tmpfs = Mounted(store.clone());
    let registry = Registry::start(&area);
    let img = Indexed::push(
        &area,
        &registry,
        &registry.addr,
        "app",
        &[
            &|r: &Path| common::oci::write_files(r, 51, &[("base/a".to_string(), 300_000)]),
            &|r: &Path| common::oci::write_files(r, 52, &[("top/b".to_string(), 300_000)]),
        ],
    );
    let snap = Snap::start(&base);
    let lower = img.make_lazily(&snap, 0, "");
    let top = img.make_lazily(&snap, 1, &lower);
    for (key, parent, file) in [("k8s.io/8/v", &top, "top/b"), ("k8s.io/9/v", &lower, "base/a")] {
        let view = snap.view_mounts(key, parent).unwrap();
        assert!(!kernel_served(&view), "{view:?}");
        let v = mount_all(&view, &area.path(key.replace('/', "-").as_str()));
        assert_eq!(fstype_below(&view), "fuse.tilefs", "{view:?}\n{}", snap.log());
        assert_eq!(
            fs::read(v.0.join(file)).unwrap(),
            fs::read(img.rootfs.join(file)).unwrap()
        );
        // (Not `tilefs umount`, which would wait for the server of the
        // FUSE mount this binds.)
        ok(Command::new("umount").arg(&v.0));
        snap.remove(key);
    }
    let log = snap.log();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("served by FUSE, not the kernel"))
        .collect();
    eprintln!("the snapshotter says: {said:?}");
    assert_eq!(said.len(), 1, "{log}");
    assert!(said[0].contains("pre-content"), "{log}");
}

/// `lazy_fetch_rest`: the filler of a kernel-served lazy image fetches
/// what no container read, in the background, until the store has the
/// whole image; a container then reads it without a fetch.
#[test]
fn lazy_fetch_rest_completes_kernel_served_images_in_the_background() {
    require(cannot_fill());
    let area = Area::new();
    let base = area.path("");
    let registry = Registry::start(&area);
    let files = std::cell::RefCell::new(Vec::new());
    let img = Indexed::push(
        &area,
        &registry,
        &registry.addr,
        "app",
        &[&|r: &Path| *files.borrow_mut() = common::oci::tree(r, 61, 12, 256 << 10)],
    );
    let config = area.path("snapshotter.toml");
    fs::write(&config, "lazy_fetch_rest = \"64M\"\n").unwrap();
    let snap = Snap::start_with(&base, &["--config", config.to_str().unwrap()]);
    let name = img.make_lazily(&snap, 0, "");
    let store = base.join("store");
    let fsck = || {
        let out = ok(Command::new(tilefs_bin())
            .args(["fsck", "--json", "--store"])
            .arg(&store));
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let blob_gets = |from: usize| {
        registry.requests()[from..]
            .iter()
            .filter(|r| r.method == "GET" && r.path.contains("/blobs/"))
            .count()
    };
    let not_fetched = |f: &serde_json::Value| -> u64 {
        f["not_fetched"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum()
    };
    assert!(not_fetched(&fsck()) > 0, "nothing to fetch lazily: {}", fsck());
    // The container's mount starts the filler; nothing is read. (When the
    // fetches happen is the filler's business: the outcome is checked.)
    let mounts = snap.prepare_mounts("k8s.io/9/ctr", &name, HashMap::new()).unwrap();
    assert!(kernel_served(&mounts), "{mounts:?}\n{}", snap.log());
    wait_until("every object of the image stored in the background", || {
        let f = fsck();
        f["placeholders"] == 0 && not_fetched(&f) == 0
    });
    let root = mount_all(&mounts, &area.path("ctr"));
    let before = registry.requests().len();
    for (f, _) in files.borrow().iter() {
        assert_eq!(
            fs::read(root.0.join(f)).unwrap(),
            fs::read(img.rootfs.join(f)).unwrap(),
            "{f}"
        );
    }
    assert_eq!(blob_gets(before), 0, "blobs fetched for files the store had");
}
