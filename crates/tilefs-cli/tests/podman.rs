//! podman (Debian's 4.3.1) with `tilefs layer-store` as its additional
//! layer store: private storage.conf, registries.conf, containers.conf and
//! signature policy per test, graphroot and runroot in the test's area,
//! docker-registry on loopback. An image with a `tilefs index` is pulled
//! without its layer blobs (the registry's access log), runs with its
//! files fetched on first read, and its paths answer across a restart of
//! the layer store; a file of a tampered blob fails to read; an image
//! without an index is pulled by podman itself; files two images share are
//! stored once; `podman push` reads the blobs through the store; `podman
//! rmi` lets go of the layers and `tilefs gc` frees their files. An
//! eStargz image is served from its tables of contents. A user the test
//! makes logs in and runs the layer store in `podman unshare`. The store
//! finds podman's credentials (`podman login`, `$REGISTRY_AUTH_FILE`; those
//! it lacks leave the pull to podman) and reaches a mirror as podman does.

mod common;

use base64::Engine;
use common::oci::*;
use common::registry::Registry;
use common::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// podman on storage of its own (graphroot, runroot, configuration in
/// `dir`); everything it made is reset when dropped.
struct Podman {
    dir: PathBuf,
    /// The user's environment, podman's and the layer store's.
    env: Vec<(&'static str, PathBuf)>,
}

/// podman's configuration in `dir`: storage with `layer_store` as its
/// additional layer store (graphroot and runroot in `dir`, for root),
/// `registries` on plain HTTP, any image accepted.
fn configure(dir: &Path, layer_store: &Path, registries: &[&str]) {
    let w = |name: &str, text: String| fs::write(dir.join(name), text).unwrap();
    w(
        "storage.conf",
        format!(
            "[storage]\ndriver = \"overlay\"\ngraphroot = \"{0}/graph\"\nrunroot = \"{0}/run\"\n\
                 [storage.options]\nadditionallayerstores = [\"{1}:ref\"]\n",
            dir.display(),
            layer_store.display()
        ),
    );
    w("registries.conf", insecure(registries));
    w(
        "policy.json",
        r#"{"default": [{"type": "insecureAcceptAnything"}]}"#.to_string(),
    );
    // podman raises a container's open files to the kernel's ceiling by
    // default, which a root without CAP_SYS_RESOURCE may not. Its engine's
    // temporary directory is its own: root's default (/run/libpod) is one
    // for every podman, and a reset of one removes it under the others.
    w(
        "containers.conf",
        format!(
            "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n\
             [engine]\nevents_logger = \"file\"\ntmp_dir = \"{}/tmp\"\n",
            dir.display()
        ),
    );
}

/// registries.conf's entries for `registries` on plain HTTP.
fn insecure(registries: &[&str]) -> String {
    registries
        .iter()
        .map(|r| format!("[[registry]]\nlocation = \"{r}\"\ninsecure = true\n"))
        .collect()
}

impl Podman {
    fn new(dir: &Path, layer_store: &Path, registries: &[&str]) -> Podman {
        configure(dir, layer_store, registries);
        Podman {
            dir: dir.to_path_buf(),
            env: Vec::new(),
        }
    }

    fn env(&self, cmd: &mut Command) {
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.env("CONTAINERS_STORAGE_CONF", self.dir.join("storage.conf"))
            .env("CONTAINERS_REGISTRIES_CONF", self.dir.join("registries.conf"))
            .env("CONTAINERS_CONF", self.dir.join("containers.conf"));
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("podman");
        self.env(&mut cmd);
        cmd.args(args).output().expect("podman (scripts/setup installs it)")
    }

    fn ok(&self, args: &[&str]) -> Vec<u8> {
        let out = self.run(args);
        assert!(out.status.success(), "podman {args:?}: {}", stderr(&out));
        out.stdout
    }

    fn pull(&self, image: &str) -> String {
        self.pull_with(&[], image)
    }

    fn pull_with(&self, flags: &[&str], image: &str) -> String {
        let policy = self.dir.join("policy.json");
        let mut args = vec!["pull", "--signature-policy", policy.to_str().unwrap()];
        args.extend_from_slice(flags);
        args.push(image);
        let out = self.run(&args);
        assert!(out.status.success(), "podman pull {image}: {}", stderr(&out));
        stderr(&out)
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.run(&["system", "reset", "--force"]);
    }
}

/// The layer store serving `store` at `mnt` (in the background), in
/// `podman`'s environment (the user's), taken down when dropped.
fn layer_store(area: &Area, store: &Path, mnt: &Path, podman: &Podman) -> Mounted {
    fs::create_dir_all(mnt).unwrap();
    let mut cmd = Command::new(tilefs_bin());
    podman.env(&mut cmd);
    let out = cmd
        .args([
            os("layer-store"),
            os("--mount"),
            mnt.as_os_str(),
            os("--store"),
            store.as_os_str(),
            os("--signature-policy"),
            podman.dir.join("policy.json").as_os_str(),
            os("--registries-conf"),
            podman.dir.join("registries.conf").as_os_str(),
            os("--log"),
            area.path("layer-store.log").as_os_str(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "layer-store: {}", stderr(&out));
    Mounted(mnt.to_path_buf())
}

/// The layer digests of `tilefs/NAME:v1`.
fn layers_of(registry: &Registry, name: &str) -> Vec<String> {
    digests(&skopeo_raw(&format!("docker://{}/tilefs/{name}:v1", registry.addr)))
}

/// The layer digests of `reference` in a registry that asks for the
/// credentials in `auth`.
fn private_layers_of(reference: &str, auth: &Path) -> Vec<String> {
    let out = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false", "--authfile"])
        .arg(auth)
        .arg(format!("docker://{reference}"))
        .output()
        .unwrap();
    assert!(out.status.success(), "skopeo inspect: {}", stderr(&out));
    digests(&serde_json::from_slice(&out.stdout).unwrap())
}

/// The layer digests of manifest `m`.
fn digests(m: &serde_json::Value) -> Vec<String> {
    m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect()
}

/// Blob GETs of any of `digests` logged since `before` requests.
fn gets_of(registry: &Registry, before: usize, digests: &[String]) -> Vec<String> {
    registry.requests()[before..]
        .iter()
        .filter(|q| q.method == "GET" && digests.iter().any(|d| q.path.ends_with(d.as_str())))
        .map(|q| q.path.clone())
        .collect()
}

/// `tilefs index` of `tilefs/NAME:v1`, with the credentials in `auth`.
fn index(area: &Area, registry: &Registry, name: &str, auth: Option<&Path>) {
    let mut cmd = Command::new(tilefs_bin());
    if let Some(a) = auth {
        cmd.env("REGISTRY_AUTH_FILE", a);
    }
    let out = cmd
        .args([
            os("index"),
            os("--tls-verify=false"),
            os("--store"),
            area.path("indexing").as_os_str(),
            os(&format!("docker://{}/tilefs/{name}:v1", registry.addr)),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "index {name}: {}", stderr(&out));
}

/// A registry that asks for alice's password, with images `names`
/// (busybox's `cat` as the entrypoint, `/msg` saying `msg`) pushed and
/// indexed: the registry, an auth.json with her credentials (podman's
/// `--authfile`), and the images' references. What the tests of
/// credentials start from.
fn behind_a_password(area: &Area, names: &[&str], msg: &str) -> (Registry, PathBuf, Vec<String>) {
    require(cannot_fuse());
    for (program, package) in [
        ("podman", "podman"),
        ("umoci", "umoci"),
        ("skopeo", "skopeo"),
        ("htpasswd", "apache2-utils"),
    ] {
        require(missing_program(program, package));
    }
    let given = area.path("given.json");
    let registry = Registry::start_with_password(area, "alice", "s3cret", &given);
    let fill = |root: &Path| {
        busybox_into(root, &["cat"]);
        fs::write(root.join("msg"), msg).unwrap();
    };
    let (entry, creds) = (["--config.entrypoint", "/bin/cat"], ["--dest-creds", "alice:s3cret"]);
    let images = names
        .iter()
        .map(|name| {
            let image = push_image_as(area, &registry, name, &[&fill], &entry, &creds);
            index(area, &registry, name, Some(&given));
            image
        })
        .collect();
    (registry, given, images)
}

#[test]
fn podman_pulls_indexed_images_through_the_layer_store() {
    require(cannot_fuse());
    require(not_root("podman's storage in a private graphroot"));
    require(missing_program("podman", "podman"));
    require(missing_program("umoci", "umoci"));
    require(missing_program("skopeo", "skopeo"));
    let area = Area::new();
    let registry = Registry::start(&area);
    // A base of busybox, a file of 300 KB and one the top layer removes;
    // the top layer adds a message.
    let base = |root: &Path| {
        busybox_into(root, &["sh", "cat", "ls"]);
        write_files(root, 7, &[("etc/big".into(), 300_000)]);
        fs::write(root.join("etc/gone"), "removed above\n").unwrap();
    };
    let top = |root: &Path| {
        fs::remove_file(root.join("etc/gone")).unwrap();
        fs::write(root.join("etc/msg"), "hello from tilefs\n").unwrap();
    };
    let other = |root: &Path| fs::write(root.join("etc/msg"), "the other image\n").unwrap();
    let secret = |root: &Path| write_files(root, 9, &[("data/x".into(), 2 << 20)]);
    let cmd = ["--config.cmd", "/bin/sh"];
    let app = push_image_with(&area, &registry, "app", &[&base, &top], &cmd);
    let app2 = push_image_with(&area, &registry, "app2", &[&base, &other], &cmd);
    let bad = push_image_with(&area, &registry, "bad", &[&base, &secret], &cmd);
    let alone = |root: &Path| {
        busybox_into(root, &["cat"]);
        fs::write(root.join("plain"), "pulled by podman\n").unwrap();
    };
    let plain = push_image_with(&area, &registry, "plain", &[&alone], &["--config.cmd", "/bin/cat"]);
    for name in ["app", "app2", "bad"] {
        index(&area, &registry, name, None);
    }
    let expected_big = {
        let d = area.dir("expected");
        write_files(&d, 7, &[("big".into(), 300_000)]);
        fs::read(d.join("big")).unwrap()
    };

    let store = area.path("store");
    let mnt = area.path("mnt");
    // Declared first, dropped last: after podman's reset.
    let mut served: Option<Mounted>;
    let second = Registry::start_named(&area, "second", "");
    let podman = Podman::new(&area.dir("podman"), &mnt, &[&registry.addr, &second.addr]);
    served = Some(layer_store(&area, &store, &mnt, &podman));
    let log = || fs::read_to_string(area.path("layer-store.log")).unwrap_or_default();

    // The pull reads manifests, configuration and the index; no layer.
    let before = registry.requests().len();
    let said = podman.pull(&app);
    assert!(!said.contains("Additional Layer Store"), "{said}");
    let layers = layers_of(&registry, "app");
    assert_eq!(gets_of(&registry, before, &layers), Vec::<String>::new(), "{}", log());
    let run = |image: &str, args: &[&str]| {
        let mut a = vec!["run", "--rm", "--network", "none", image];
        a.extend_from_slice(args);
        podman.run(&a)
    };
    let out = run(&app, &["cat", "/etc/msg", "/etc/big"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut want = b"hello from tilefs\n".to_vec();
    want.extend_from_slice(&expected_big);
    assert!(out.stdout == want, "the container reads the image's bytes");
    let out = run(&app, &["ls", "/etc/gone"]);
    assert!(!out.status.success(), "a file the top layer removed is gone");
    let images = String::from_utf8(podman.ok(&["images", "--format", "{{.Size}}"])).unwrap();
    assert!(!images.trim().is_empty() && !images.contains("0 B"), "{images}");

    // The same paths answer after a restart of the layer store.
    served.take().unwrap().unmount();
    served = Some(layer_store(&area, &store, &mnt, &podman));
    let out = run(&app, &["cat", "/etc/msg"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello from tilefs\n",
        "{}",
        stderr(&out)
    );

    // Another local user reaches the mount (it is allow_other) but cannot
    // make root's store resolve a reference: no registry request, ENOENT.
    let traversable = fs::metadata(area.tmp.path()).unwrap().permissions();
    fs::set_permissions(area.tmp.path(), fs::Permissions::from_mode(0o711)).unwrap();
    let encoded = base64::engine::general_purpose::STANDARD.encode(&app2);
    let probe = mnt.join(&encoded).join(&layers_of(&registry, "app2")[1]).join("info");
    let before = registry.requests().len();
    let out = Command::new("runuser")
        .args(["-u", "nobody", "--", "stat"])
        .arg(&probe)
        .output()
        .unwrap();
    fs::set_permissions(area.tmp.path(), traversable).unwrap();
    assert!(!out.status.success(), "another user made the store resolve {app2}");
    assert!(stderr(&out).contains("No such file"), "{}", stderr(&out));
    assert_eq!(
        registry.requests().len(),
        before,
        "another user's lookup reached the registry"
    );
    assert!(probe.exists(), "the same path resolves for the store's owner");

    // Another image with the same base files: none fetched or stored again.
    let objects = objects_in(&store);
    let before = registry.requests().len();
    podman.pull(&app2);
    let out = run(&app2, &["cat", "/etc/msg", "/etc/big"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(out.stdout.starts_with(b"the other image\n") && out.stdout.ends_with(&expected_big));
    let layers2 = layers_of(&registry, "app2");
    assert_eq!(gets_of(&registry, before, &layers2[..1]), Vec::<String>::new());
    assert_eq!(objects_in(&store), objects, "busybox and etc/big are stored once");

    // `podman save` reads the layers' blobs through the store.
    let saved = area.path("saved.tar");
    podman.ok(&[
        "save",
        "--format",
        "docker-archive",
        "-o",
        saved.to_str().unwrap(),
        &app,
    ]);
    let blob_sizes: u64 = skopeo_raw(&format!("docker://{app}"))["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap())
        .sum();
    let saved_len = fs::metadata(&saved).unwrap().len();
    assert!(
        saved_len >= blob_sizes,
        "{saved_len} bytes saved, {blob_sizes} of blobs"
    );

    // `podman push` to another registry reads the blobs through `blob`
    // (by range from the first registry); pulled back by podman itself
    // into storage of its own, the copy runs with the same bytes.
    let copy = format!("{}/tilefs/copy:v1", second.addr);
    let before = registry.requests().len();
    podman.ok(&["push", &app, &format!("docker://{copy}")]);
    let read = gets_of(&registry, before, &layers);
    assert!(!read.is_empty(), "the push read no blob: {}", log());
    let back = Podman::new(&area.dir("podman-back"), &mnt, &[&second.addr]);
    let before = second.requests().len();
    back.pull(&copy);
    let copied = digests(&skopeo_raw(&format!("docker://{copy}")));
    assert_eq!(gets_of(&second, before, &copied).len(), copied.len());
    let out = back.run(&["run", "--rm", "--network", "none", &copy, "cat", "/etc/msg", "/etc/big"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(out.stdout == want, "the pushed copy holds the image's bytes");
    drop(back);

    // A tampered blob: the file whose bytes it holds does not read.
    podman.pull(&bad);
    let tampered = registry.tamper_largest_blob();
    assert_eq!(tampered, layers_of(&registry, "bad")[1]);
    let out = run(&bad, &["cat", "/data/x"]);
    assert!(!out.status.success(), "a tampered file must not read");
    assert!(log().contains("/data/x"), "{}", log());

    // An image without an index: podman pulls its layers itself.
    let before = registry.requests().len();
    podman.pull(&plain);
    let plain_layers = layers_of(&registry, "plain");
    assert_eq!(gets_of(&registry, before, &plain_layers).len(), plain_layers.len());
    let out = run(&plain, &["cat", "/plain"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "pulled by podman\n",
        "{}",
        stderr(&out)
    );

    // Removed from podman, the layers are let go and gc frees their files.
    assert!(!held_images(&store).is_empty());
    podman.ok(&["rmi", &app, &app2, &bad, &plain]);
    podman.ok(&["image", "prune", "--force"]);
    assert_eq!(held_images(&store), Vec::<PathBuf>::new());
    let out = tilefs_any(&[os("gc"), os("--store"), store.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(objects_in(&store), 0, "{}", stderr(&out));
    drop(podman);
    drop(served);
}

/// A user made for a test (with subordinate ids, as podman's rootless mode
/// needs), removed with its home and processes when dropped.
struct TestUser {
    name: String,
    home: PathBuf,
    runtime: PathBuf,
}

impl TestUser {
    fn new() -> TestUser {
        let name = format!("tfpod{}", std::process::id());
        checked(Command::new("useradd").args(["-m", "-s", "/bin/sh"]).arg(&name));
        let has_ids = |f: &str| {
            fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .any(|l| l.starts_with(&format!("{name}:")))
        };
        if !has_ids("/etc/subuid") || !has_ids("/etc/subgid") {
            checked(
                Command::new("usermod")
                    .args(["--add-subuids", "400000-465535", "--add-subgids", "400000-465535"])
                    .arg(&name),
            );
        }
        let home = PathBuf::from(format!("/home/{name}"));
        let runtime = PathBuf::from(format!("/tmp/{name}-runtime"));
        let u = TestUser { name, home, runtime };
        fs::create_dir_all(&u.runtime).unwrap();
        u.chown(&u.runtime);
        u
    }

    fn chown(&self, path: &Path) {
        checked(
            Command::new("chown")
                .arg("-R")
                .arg(format!("{0}:{0}", self.name))
                .arg(path),
        );
    }

    /// `args` run as the user, in its environment.
    fn cmd(&self, args: &[&std::ffi::OsStr]) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", &self.name, "--", "env"])
            .arg(format!("HOME={}", self.home.display()))
            .arg(format!("XDG_RUNTIME_DIR={}", self.runtime.display()))
            .current_dir(&self.home)
            .args(args);
        c
    }

    /// The ids of the user's processes.
    fn processes(&self) -> Vec<u32> {
        let out = Command::new("pgrep").args(["-u", &self.name]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let mnt = self.home.join("mnt");
        let _ = self
            .cmd(&[os("podman"), os("unshare"), os("umount"), mnt.as_os_str()])
            .output();
        let _ = self
            .cmd(&[os("podman"), os("system"), os("reset"), os("--force")])
            .output();
        // What is left of the user's processes (all this test's): ended by id.
        for _ in 0..50 {
            let left = self.processes();
            if left.is_empty() {
                break;
            }
            for pid in left {
                let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = Command::new("userdel").arg("-r").arg(&self.name).output();
        let _ = fs::remove_dir_all(&self.runtime);
    }
}

#[test]
fn a_rootless_user_runs_the_layer_store_in_podman_unshare() {
    require(not_root("making a user for the rootless case"));
    require(missing_program("newuidmap", "uidmap"));
    let area = Area::new();
    // The registry asks for a password: the user's `podman login` gives it
    // to podman and the layer store alike.
    let (registry, given, images) = behind_a_password(&area, &["app"], "rootless and lazy\n");
    let [app]: [String; 1] = images.try_into().unwrap();

    let user = TestUser::new();
    let conf = user.home.join(".config/containers");
    fs::create_dir_all(&conf).unwrap();
    let mnt = user.home.join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    // podman's own configuration of the user; the layer store reads the
    // same registries.conf by default.
    configure(&conf, &mnt, &[&registry.addr]);
    let storage = format!(
        "[storage]\ndriver = \"overlay\"\n[storage.options]\nadditionallayerstores = [\"{}:ref\"]\n",
        mnt.display()
    );
    fs::write(conf.join("storage.conf"), storage).unwrap();
    let tilefs = user.home.join("tilefs");
    fs::copy(tilefs_bin(), &tilefs).unwrap();
    user.chown(&user.home);

    let login = user
        .cmd(&[
            os("podman"),
            os("login"),
            os("--tls-verify=false"),
            os("-u"),
            os("alice"),
        ])
        .args(["-p", "s3cret", &registry.addr])
        .output()
        .unwrap();
    assert!(login.status.success(), "podman login: {}", stderr(&login));
    assert!(user.runtime.join("containers/auth.json").is_file());

    let policy = conf.join("policy.json");
    let out = user
        .cmd(&[
            os("podman"),
            os("unshare"),
            tilefs.as_os_str(),
            os("layer-store"),
            os("--mount"),
            mnt.as_os_str(),
            os("--store"),
            user.home.join("store").as_os_str(),
            os("--signature-policy"),
            policy.as_os_str(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "layer-store in podman unshare: {}", stderr(&out));

    let before = registry.requests().len();
    let out = user
        .cmd(&[
            os("podman"),
            os("pull"),
            os("--signature-policy"),
            policy.as_os_str(),
            os(&app),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "rootless pull: {}", stderr(&out));
    let layers = private_layers_of(&app, &given);
    let log = user.home.join(".local/state/tilefs/layer-store.log");
    let said = || fs::read_to_string(&log).unwrap_or_else(|e| format!("{}: {e}", log.display()));
    assert_eq!(gets_of(&registry, before, &layers), Vec::<String>::new(), "{}", said());
    let out = user
        .cmd(&[
            os("podman"),
            os("run"),
            os("--rm"),
            os("--network"),
            os("none"),
            os(&app),
            os("/msg"),
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "rootless and lazy\n",
        "{}",
        stderr(&out)
    );
    // Its messages went where the user may write (there is no system log
    // here, or they went there).
    assert!(log.exists() || Path::new("/dev/log").exists(), "{}", said());
}

#[test]
fn an_estargz_image_is_served_from_its_table_of_contents() {
    require(cannot_fuse());
    require(not_root("podman's storage in a private graphroot"));
    require(missing_program("podman", "podman"));
    require(missing_program("skopeo", "skopeo"));
    let Some(generator) = common::seekable::generator() else {
        return;
    };
    let area = Area::new();
    let registry = Registry::start(&area);
    let base = |root: &Path| {
        busybox_into(root, &["cat"]);
        write_files(root, 5, &[("data/big".into(), 3 << 20)]);
    };
    let top = |root: &Path| fs::write(root.join("msg"), "from a table of contents\n").unwrap();
    let app = common::seekable::push_seekable(&generator, &area, &registry, "sgz", "estargz", &[&base, &top], false);
    let store = area.path("store");
    let mnt = area.path("mnt");
    // Declared first, dropped last: after podman's reset.
    let served: Option<Mounted>;
    let podman = Podman::new(&area.dir("podman"), &mnt, &[&registry.addr]);
    served = Some(layer_store(&area, &store, &mnt, &podman));
    let log = || fs::read_to_string(area.path("layer-store.log")).unwrap_or_default();
    let before = registry.requests().len();
    podman.pull(&app);
    // Only the tables of contents are read (a range at each layer's end).
    let layers = layers_of(&registry, "sgz");
    let sizes: u64 = skopeo_raw(&format!("docker://{app}"))["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap())
        .sum();
    let fetched = blob_bytes_since(&registry, before);
    assert!(
        fetched * 10 < sizes,
        "{fetched} bytes of {sizes} fetched by the pull; {}",
        log()
    );
    assert!(!gets_of(&registry, before, &layers).is_empty(), "its tables were read");
    let out = podman.run(&["run", "--rm", "--network", "none", &app, "cat", "/msg"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "from a table of contents\n",
        "{} {}",
        stderr(&out),
        log()
    );
    let fetched = blob_bytes_since(&registry, before);
    assert!(fetched * 2 < sizes, "cat of one file fetched {fetched} of {sizes}");

    // The same layers under another reference (looked up as podman does):
    // served the images made already, no table fetched again.
    let again = format!("{}:again", app.rsplit_once(':').unwrap().0);
    let out = Command::new("skopeo")
        .args(["copy", "-q", "--src-tls-verify=false", "--dest-tls-verify=false"])
        .args([format!("docker://{app}"), format!("docker://{again}")])
        .output()
        .unwrap();
    assert!(out.status.success(), "skopeo copy: {}", stderr(&out));
    let before = registry.requests().len();
    let encoded = base64::engine::general_purpose::STANDARD.encode(&again);
    for l in &layers {
        assert!(
            mnt.join(&encoded).join(l).join("diff").is_dir(),
            "{again} {l}: {}",
            log()
        );
    }
    let top = mnt.join(&encoded).join(layers.last().unwrap()).join("diff/msg");
    assert_eq!(fs::read_to_string(&top).unwrap(), "from a table of contents\n");
    assert_eq!(gets_of(&registry, before, &layers), Vec::<String>::new(), "{}", log());
    drop(podman);
    drop(served);
}

#[test]
fn the_layer_store_reaches_registries_with_podmans_credentials_and_mirrors() {
    require(not_root("podman's storage in a private graphroot"));
    let area = Area::new();
    let (registry, given, images) = behind_a_password(&area, &["app", "app2"], "behind a password\n");
    let [app, app2]: [String; 2] = images.try_into().unwrap();
    let store = area.path("store");
    let mnt = area.path("mnt");
    // Declared first, dropped last: after podman's reset.
    let mut served: Option<Mounted>;
    let mut podman = Podman::new(&area.dir("podman"), &mnt, &[&registry.addr]);
    // The user's environment, podman's and the layer store's: no auth.json
    // of this machine's.
    let run_dir = area.dir("run");
    podman.env = vec![("HOME", area.dir("home")), ("XDG_RUNTIME_DIR", run_dir.clone())];
    served = Some(layer_store(&area, &store, &mnt, &podman));
    let log = || fs::read_to_string(area.path("layer-store.log")).unwrap_or_default();
    let cat = |podman: &Podman, image: &str| {
        let out = podman.run(&["run", "--rm", "--network", "none", image, "/msg"]);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "behind a password\n",
            "{} {}",
            stderr(&out),
            log()
        );
    };
    let layers = private_layers_of(&app, &given);

    // Credentials podman has and the layer store has not (podman's
    // --authfile): podman pulls the layers itself, without a warning.
    let before = registry.requests().len();
    let said = podman.pull_with(&["--authfile", given.to_str().unwrap()], &app);
    assert!(!said.contains("Additional Layer Store"), "{said}");
    assert_eq!(gets_of(&registry, before, &layers).len(), layers.len(), "{}", log());
    assert!(log().contains("no credentials for"), "{}", log());

    // `podman login`: its auth.json (in $XDG_RUNTIME_DIR) is the store's.
    podman.ok(&[
        "login",
        "--tls-verify=false",
        "-u",
        "alice",
        "-p",
        "s3cret",
        &registry.addr,
    ]);
    assert!(run_dir.join("containers/auth.json").is_file());
    // At once, the same image again: the store does not answer from the
    // failure it found before the login.
    podman.ok(&["rmi", &app]);
    let before = registry.requests().len();
    podman.pull(&app);
    assert_eq!(gets_of(&registry, before, &layers), Vec::<String>::new(), "{}", log());
    cat(&podman, &app);

    // $REGISTRY_AUTH_FILE, podman logged out: the file is the store's.
    podman.ok(&["logout", &registry.addr]);
    served.take().unwrap().unmount();
    podman.env.push(("REGISTRY_AUTH_FILE", given.clone()));
    served = Some(layer_store(&area, &store, &mnt, &podman));
    let before = registry.requests().len();
    podman.pull(&app2);
    let layers2 = private_layers_of(&app2, &given);
    assert_eq!(gets_of(&registry, before, &layers2), Vec::<String>::new(), "{}", log());
    cat(&podman, &app2);

    // A registry that has a mirror: podman pulls from the mirror and hands
    // the layer store the image's name (mirrored.invalid/...), which the
    // store reaches through the same mirror. Nothing of it is left in
    // podman's storage to reuse. (Not by a short name: podman would record
    // its alias in root's /var/cache/containers.)
    podman.ok(&["rmi", &app2]);
    podman.ok(&["rmi", &app]);
    fs::write(
        podman.dir.join("registries.conf"),
        format!(
            "{}[[registry]]\nlocation = \"mirrored.invalid\"\n\
             [[registry.mirror]]\nlocation = \"{}\"\ninsecure = true\n",
            insecure(&[&registry.addr]),
            registry.addr
        ),
    )
    .unwrap();
    let before = registry.requests().len();
    podman.pull("mirrored.invalid/tilefs/app2:v1");
    assert_eq!(gets_of(&registry, before, &layers2), Vec::<String>::new(), "{}", log());
    cat(&podman, "mirrored.invalid/tilefs/app2:v1");
    drop(podman);
    drop(served);
}
