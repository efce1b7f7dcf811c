//! `tilefs snapshotter` under containerd's CRI plugin, the way Kubernetes
//! runs containers: crictl pulls images and runs pods through a real
//! containerd (Debian's) with runc, the images (and the pods' pause image,
//! built here) served by Debian's docker-registry on loopback. Pods use the
//! host's network, so no CNI plugin is needed. Every daemon, process,
//! mount and cgroup a test starts is stopped and removed when it ends,
//! whether it passes or not.

mod common;

use common::oci::{busybox_into, push_image_with};
use common::registry::Registry;
use common::*;
use std::cell::Cell;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The containerd namespace CRI keeps its images and containers in.
const NS: &str = "k8s.io";

/// How long one crictl call may take (a pull or a pod start on this loaded
/// 2-core machine can take a while; crictl's default is 2 s).
const CRICTL_TIMEOUT: &str = "300s";

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

/// A command that must succeed; its stdout.
use common::oci::checked as ok;

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < limit, "{what}: not after {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A pod sandbox CRI runs: its id, and the config crictl made it from
/// (crictl's `create` wants it again).
pub struct Pod {
    pub id: String,
    pub name: String,
    config: PathBuf,
}

/// The registry, `tilefs snapshotter` and containerd with its CRI plugin,
/// all in the test's directory; everything they started is stopped and
/// removed on drop.
pub struct CriRig {
    area: PathBuf,
    sock: PathBuf,
    snap_sock: PathBuf,
    /// The snapshotter's `--root`.
    pub root: PathBuf,
    /// The snapshotter's `--store`.
    pub store: PathBuf,
    /// The sandbox (pause) image each pod starts with.
    pub pause: String,
    /// The pods' cgroups (cgroupfs) go under this one, named after the
    /// test's directory: its leftovers can be found and removed.
    cgroup_parent: String,
    pods: Cell<u32>,
    containerd: Option<Child>,
    snapshotter: Option<Child>,
    registry: Option<Registry>,
    /// The snapshotter's arguments besides root, store and socket.
    snapshotter_args: Vec<String>,
    /// More registries containerd reaches over plain HTTP.
    plain_http: Vec<String>,
}

impl CriRig {
    pub fn start(area: &Area) -> CriRig {
        CriRig::start_with(area, &[])
    }

    /// With `tilefs snapshotter` given `args` too.
    pub fn start_with(area: &Area, args: &[&str]) -> CriRig {
        CriRig::start_opts(area, args, &[])
    }

    /// With `tilefs snapshotter` given `args` too, and containerd reaching
    /// the registries at `plain_http` (`127.0.0.1:PORT`) over plain HTTP.
    pub fn start_opts(area: &Area, args: &[&str], plain_http: &[&str]) -> CriRig {
        require_tools();
        let base = area.path("");
        let dir_name = base
            .file_name()
            .unwrap()
            .to_string_lossy()
            .trim_start_matches('.')
            .to_string();
        let mut rig = CriRig {
            area: base.clone(),
            sock: base.join("c.sock"),
            snap_sock: base.join("s.sock"),
            root: base.join("snaproot"),
            store: base.join("store"),
            pause: String::new(),
            cgroup_parent: format!("/tilefs-cri-{dir_name}"),
            pods: Cell::new(0),
            containerd: None,
            snapshotter: None,
            registry: Some(Registry::start(area)),
            // The lazy path reaches the plain-HTTP registry.
            snapshotter_args: ["--tls-verify=false"]
                .iter()
                .chain(args)
                .map(|a| a.to_string())
                .collect(),
            plain_http: plain_http.iter().map(|a| a.to_string()).collect(),
        };
        // CRI pulls its sandbox image like any other: ours is busybox
        // sleeping until StopPodSandbox kills it.
        rig.pause = push_image_with(
            area,
            rig.registry(),
            "pause",
            &[&|r: &Path| busybox_into(r, &["sleep"])],
            &["--config.entrypoint", "/bin/sleep", "--config.cmd", "inf"],
        );
        rig.start_snapshotter();
        for d in ["cni/bin", "cni/conf", "pod-logs"] {
            area.dir(d);
        }
        let config = base.join("containerd.toml");
        fs::write(&config, rig.containerd_config()).unwrap();
        let endpoint = format!("unix://{}", rig.sock.display());
        fs::write(
            base.join("crictl.yaml"),
            format!("runtime-endpoint: {endpoint}\nimage-endpoint: {endpoint}\ntimeout: 300\n"),
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
        while !run(rig.crictl_within("5s").arg("info")).status.success() {
            if let Ok(Some(status)) = rig.containerd.as_mut().unwrap().try_wait() {
                panic!("containerd exited: {status}");
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "containerd's CRI plugin did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        rig
    }

    /// containerd's config: its own root, state and sockets in the test's
    /// directory, the CRI plugin on the tilefs snapshotter.
    fn containerd_config(&self) -> String {
        let p = |rel: &str| self.area.join(rel).display().to_string();
        let cri = "plugins.\"io.containerd.grpc.v1.cri\"";
        let reg = &self.registry().addr;
        let more: String = self
            .plain_http
            .iter()
            .map(|r| format!("[{cri}.registry.mirrors.\"{r}\"]\n  endpoint = [\"http://{r}\"]\n"))
            .collect();
        format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[proxy_plugins]
  [proxy_plugins.tilefs]
    type = "snapshot"
    address = "{snap_sock}"
[{cri}]
  sandbox_image = "{pause}"
  # The sandbox's runc would set oom_score_adj -998, which needs
  # CAP_SYS_RESOURCE (machines and containers without it refuse): this
  # keeps it at containerd's own.
  restrict_oom_score_adj = true
[{cri}.containerd]
  snapshotter = "tilefs"
  # CRI's labels (cri.image-ref, cri.layer-digest, ...) go to Prepare.
  disable_snapshot_annotations = false
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  # runc's state in the test's directory, not /run/containerd/runc.
  Root = "{runc}"
[{cri}.cni]
  bin_dir = "{cni_bin}"
  conf_dir = "{cni_conf}"
[{cri}.registry.mirrors."{reg}"]
  endpoint = ["http://{reg}"]
{more}"#,
            root = p("croot"),
            state = p("cstate"),
            sock = self.sock.display(),
            snap_sock = self.snap_sock.display(),
            pause = self.pause,
            runc = p("runc"),
            cni_bin = p("cni/bin"),
            cni_conf = p("cni/conf"),
        )
    }

    pub fn start_snapshotter(&mut self) {
        // Removed snapshots' objects collected a second after; CRI's image
        // filesystem path where this containerd's CRI says it is.
        let imagefs = format!(
            "--cri-imagefs={}",
            self.area.join("croot/io.containerd.snapshotter.v1.tilefs").display()
        );
        let args: Vec<&str> = ["--gc-delay=1", imagefs.as_str()]
            .into_iter()
            .chain(self.snapshotter_args.iter().map(String::as_str))
            .collect();
        self.snapshotter = Some(common::spawn_snapshotter(
            &self.root,
            &self.store,
            &self.snap_sock,
            &args,
            &self.area.join("snapshotter.log"),
        ));
        // containerd's gRPC client reconnects to a restarted plugin after
        // its backoff (a second or more): wait until it has.
        if self.containerd.is_some() {
            wait_for(
                "containerd reconnecting to the snapshotter",
                Duration::from_secs(60),
                || run(self.snapshots().arg("ls")).status.success(),
            );
        }
    }

    /// Stops the snapshotter with `signal` ("-TERM", "-KILL").
    pub fn stop_snapshotter(&mut self, signal: &str) {
        common::stop_child(&mut self.snapshotter, signal);
    }

    /// A clean stop and a start of the snapshotter, containerd reconnected.
    pub fn restart_snapshotter(&mut self) {
        self.stop_snapshotter("-TERM");
        self.start_snapshotter();
    }

    pub fn registry(&self) -> &Registry {
        self.registry.as_ref().unwrap()
    }

    /// The registry's `127.0.0.1:PORT` (images are `ADDR/NAME:TAG`).
    pub fn registry_addr(&self) -> &str {
        &self.registry().addr
    }

    /// crictl on containerd's CRI socket.
    pub fn crictl(&self) -> Command {
        self.crictl_within(CRICTL_TIMEOUT)
    }

    fn crictl_within(&self, timeout: &str) -> Command {
        self.crictl_images_at(&self.sock, timeout)
    }

    /// crictl whose image calls go to the snapshotter's socket (its CRI
    /// image service proxy, `[cri_keychain]`), as the kubelet's
    /// --image-service-endpoint would.
    pub fn crictl_via_snapshotter(&self) -> Command {
        self.crictl_images_at(&self.snap_sock, CRICTL_TIMEOUT)
    }

    fn crictl_images_at(&self, images: &Path, timeout: &str) -> Command {
        let endpoint = format!("unix://{}", self.sock.display());
        let images = format!("unix://{}", images.display());
        let mut c = Command::new("crictl");
        // Our own config file, so a host's /etc/crictl.yaml plays no part.
        c.arg("--config")
            .arg(self.area.join("crictl.yaml"))
            .args(["--runtime-endpoint", &endpoint, "--image-endpoint", &images])
            .args(["--timeout", timeout]);
        c
    }

    /// containerd's CRI socket.
    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// ctr in CRI's namespace.
    pub fn ctr(&self) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address").arg(&self.sock).arg("--namespace").arg(NS);
        c
    }

    /// `ctr snapshots` of the tilefs snapshotter, in CRI's namespace.
    pub fn snapshots(&self) -> Command {
        let mut c = self.ctr();
        c.args(["snapshots", "--snapshotter", "tilefs"]);
        c
    }

    /// `crictl pull`: CRI fetches and unpacks `image` onto the snapshotter.
    /// Returns the image's id (its config's digest).
    pub fn pull(&self, image: &str) -> String {
        let out = ok(self.crictl().args(["pull", image]));
        // "Image is up to date for sha256:..."
        out.split_whitespace()
            .last()
            .unwrap_or_else(|| panic!("crictl pull printed no image id: {out:?}"))
            .to_string()
    }

    /// A pod sandbox on the host's network, started (its pause container
    /// running).
    pub fn run_pod(&self, name: &str) -> Pod {
        self.pods.set(self.pods.get() + 1);
        let logs = self.area.join("pod-logs").join(name);
        fs::create_dir_all(&logs).unwrap();
        let config = self.area.join(format!("pod-{name}.json"));
        let json = serde_json::json!({
            "metadata": {"name": name, "namespace": "tilefs-test", "uid": format!("{name}-uid"), "attempt": 0},
            "log_directory": logs,
            "linux": {
                "cgroup_parent": self.cgroup_parent,
                // 2 is NODE: the host's network namespace, no CNI.
                "security_context": {"namespace_options": {"network": 2}},
            },
        });
        fs::write(&config, json.to_string()).unwrap();
        let id = ok(self.crictl().arg("runp").arg(&config)).trim().to_string();
        Pod {
            id,
            name: name.to_string(),
            config,
        }
    }

    /// A container in `pod` running `/bin/sh -c cmd` in `image` (pulled
    /// already, as the kubelet does first), created and started: its id.
    pub fn start_container(&self, pod: &Pod, name: &str, image: &str, cmd: &str) -> String {
        let config = self.area.join(format!("container-{}-{name}.json", pod.name));
        let json = serde_json::json!({
            "metadata": {"name": name},
            "image": {"image": image},
            "command": ["/bin/sh", "-c", cmd],
            "log_path": format!("{name}.log"),
            "linux": {},
        });
        fs::write(&config, json.to_string()).unwrap();
        let id = ok(self.crictl().arg("create").arg(&pod.id).arg(&config).arg(&pod.config))
            .trim()
            .to_string();
        ok(self.crictl().args(["start", &id]));
        id
    }

    /// `crictl inspect` of a container (`inspectp` of a pod): its JSON.
    fn inspect(&self, what: &str, id: &str) -> serde_json::Value {
        let out = ok(self.crictl().args([what, "-o", "json", id]));
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("crictl {what}: {e}: {out}"))
    }

    /// Waits for a container to exit: its exit code.
    pub fn wait_exited(&self, id: &str) -> i64 {
        let mut code = None;
        wait_for(&format!("container {id} exiting"), Duration::from_secs(120), || {
            let status = &self.inspect("inspect", id)["status"];
            if status["state"] == "CONTAINER_EXITED" {
                code = status["exitCode"].as_i64();
            }
            code.is_some()
        });
        code.unwrap()
    }

    /// What a container wrote to its stdout (`crictl logs`).
    pub fn logs(&self, id: &str) -> String {
        ok(self.crictl().args(["logs", id]))
    }

    /// `crictl stop` and `rm` of a container.
    pub fn remove_container(&self, id: &str) {
        ok(self.crictl().args(["stop", id]));
        ok(self.crictl().args(["rm", id]));
    }

    /// `crictl stopp` and `rmp` of a pod.
    pub fn remove_pod(&self, pod: &Pod) {
        ok(self.crictl().args(["stopp", &pod.id]));
        ok(self.crictl().args(["rmp", &pod.id]));
    }

    /// The mount points that name one of `ids` (a container's rootfs, a
    /// pod's /dev/shm), from this namespace's mount table.
    pub fn mounts_of(&self, ids: &[&str]) -> Vec<String> {
        mountinfo_lines()
            .iter()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| ids.iter().any(|id| m.contains(id)))
            .map(str::to_string)
            .collect()
    }

    /// A pod, a container in it running `cmd` in `image` (pulled already)
    /// until it exits (with 0), then both stopped and removed, nothing of
    /// them left mounted: what the container wrote to its stdout.
    pub fn run_pod_and_container(&self, image: &str, cmd: &str) -> String {
        let pod = self.run_pod(&format!("pod{}", self.pods.get() + 1));
        let id = self.start_container(&pod, "main", image, cmd);
        let code = self.wait_exited(&id);
        let logs = self.logs(&id);
        assert_eq!(code, 0, "the container exited with {code}: {logs}");
        self.remove_container(&id);
        self.remove_pod(&pod);
        let left = self.mounts_of(&[&pod.id, &id]);
        assert!(left.is_empty(), "still mounted after the pod's removal: {left:?}");
        logs
    }

    /// The tilefs snapshotter's snapshots in CRI's namespace: (key,
    /// parent, kind).
    pub fn snapshot_list(&self) -> Vec<(String, String, String)> {
        ok(self.snapshots().arg("ls"))
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f.as_slice() {
                    [k, p, kind] => Some((k.to_string(), p.to_string(), kind.to_string())),
                    [k, kind] => Some((k.to_string(), String::new(), kind.to_string())),
                    _ => None,
                }
            })
            .collect()
    }

    /// The snapshotter's own records (`ROOT/metadata/ID`, JSON): key,
    /// kind and the labels containerd gave it.
    pub fn records(&self) -> Vec<serde_json::Value> {
        let Ok(rd) = fs::read_dir(self.root.join("metadata")) else {
            return Vec::new();
        };
        rd.flatten()
            .filter(|e| e.file_name().to_string_lossy().parse::<u64>().is_ok())
            .filter_map(|e| serde_json::from_slice(&fs::read(e.path()).ok()?).ok())
            .collect()
    }

    /// Waits until the snapshotter stored every committed snapshot's layer
    /// (it does after Commit returns): one held image each.
    pub fn settle(&self) {
        wait_for("the snapshotter storing every layer", Duration::from_secs(120), || {
            let committed = self.snapshot_list().iter().filter(|s| s.2 == "Committed").count();
            held_images(&self.store).len() == committed
        });
    }

    /// Processes (not this one) whose command line names `needle`.
    fn processes_naming(needle: &str) -> Vec<i32> {
        let me = std::process::id() as i32;
        fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != me)
            .filter(|pid| {
                fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    c.split(|&b| b == 0)
                        .any(|a| String::from_utf8_lossy(a).contains(needle))
                })
            })
            .collect()
    }

    /// This rig's cgroup directories, in every hierarchy, deepest first.
    fn cgroups(&self) -> Vec<PathBuf> {
        let name = self.cgroup_parent.trim_start_matches('/');
        let mut hierarchies = vec![PathBuf::from("/sys/fs/cgroup")];
        hierarchies.extend(
            fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path()),
        );
        let mut out = Vec::new();
        let mut stack: Vec<PathBuf> = hierarchies
            .iter()
            .map(|h| h.join(name))
            .filter(|p| p.is_dir())
            .collect();
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(e.path());
                }
            }
            out.push(d);
        }
        out.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        out
    }

    /// Whatever is mounted below `dir`, deepest first: detached.
    fn unmount_below(dir: &Path) {
        let mut mounts: Vec<String> = mountinfo_lines()
            .iter()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .filter(|m| Path::new(m).starts_with(dir))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let quiet = |c: &mut Command| c.stderr(Stdio::null()).status().is_ok_and(|s| s.success());
            if !quiet(Command::new("umount").arg(&m)) {
                quiet(Command::new("umount").args(["-l", &m]));
            }
        }
    }
}

impl Drop for CriRig {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in ["snapshotter.log", "containerd.log"] {
                let text = fs::read_to_string(self.area.join(log)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                eprintln!("--- {log} (last lines):");
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        // Pods through CRI first: it stops their containers and takes down
        // their mounts; briefly, for a containerd that may hang.
        if self.containerd.is_some() {
            if let Ok(o) = self.crictl_within("20s").args(["pods", "-q"]).output() {
                for id in String::from_utf8_lossy(&o.stdout).lines() {
                    let _ = self.crictl_within("20s").args(["stopp", id]).output();
                    let _ = self.crictl_within("20s").args(["rmp", "-f", id]).output();
                }
            }
        }
        if let Some(mut c) = self.containerd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // What CRI could not stop: shims (which name containerd's socket),
        // runc's containers (in our runc root) and every process left in
        // the pods' cgroups.
        let shim_sockets: Vec<PathBuf> = fs::read_dir(self.area.join("cstate/io.containerd.runtime.v2.task").join(NS))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| fs::read_to_string(e.path().join("address")).ok())
            .filter_map(|a| a.trim().strip_prefix("unix://").map(PathBuf::from))
            .collect();
        for pid in Self::processes_naming(&self.sock.display().to_string()) {
            kill9(pid);
        }
        let runc_root = self.area.join("runc").join(NS);
        for e in fs::read_dir(&runc_root).into_iter().flatten().flatten() {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&runc_root)
                .args(["delete", "--force"])
                .arg(e.file_name())
                .stderr(Stdio::null())
                .status();
        }
        let cgroups = self.cgroups();
        for cg in &cgroups {
            for pid in fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default().lines() {
                if let Ok(pid) = pid.trim().parse() {
                    kill9(pid);
                }
            }
        }
        let t = Instant::now();
        for cg in &cgroups {
            // A killed process leaves its cgroup a moment later.
            while fs::remove_dir(cg).is_err() && cg.exists() && t.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // The sockets of shims that were killed (they live in
        // /run/containerd/s, outside the test's directory).
        for s in shim_sockets {
            let _ = fs::remove_file(s);
        }
        // Containers' mounts before the snapshotter's images below them.
        Self::unmount_below(&self.area.join("cstate"));
        self.stop_snapshotter("-TERM");
        if let Some(mut r) = self.registry.take() {
            r.stop();
        }
        Self::unmount_below(&self.area);
    }
}

fn kill9(pid: i32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

fn require_tools() {
    assert!(is_root(), "the CRI tests run as root");
    for t in [
        "containerd",
        "ctr",
        "runc",
        "crictl",
        "docker-registry",
        "skopeo",
        "umoci",
    ] {
        assert!(have(t), "{t} is needed (scripts/setup installs it)");
    }
    assert!(
        Path::new("/bin/busybox").exists(),
        "busybox-static is needed (scripts/setup installs it)"
    );
}

/// The chain ids of an image's layers, bottom first: the keys of the
/// committed snapshots containerd unpacks it into.
fn chain_ids(image: &str) -> Vec<String> {
    let out = ok(Command::new("skopeo").args([
        "inspect",
        "--config",
        "--raw",
        "--tls-verify=false",
        &format!("docker://{image}"),
    ]));
    let config: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut chain: Vec<String> = Vec::new();
    for diff in config["rootfs"]["diff_ids"].as_array().unwrap() {
        let diff = diff.as_str().unwrap();
        let next = match chain.last() {
            None => diff.to_string(),
            Some(below) => format!("sha256:{}", sha256_hex(format!("{below} {diff}").as_bytes())),
        };
        chain.push(next);
    }
    chain
}

#[test]
fn cri_pulls_and_runs_a_pod_on_tilefs() {
    let area = Area::new();
    let mut rig = CriRig::start(&area);
    let image = push_image_with(
        &area,
        rig.registry(),
        "app",
        &[
            &|r: &Path| {
                busybox_into(r, &["sh", "cat", "echo"]);
                write_files_for_app(r, 1, 6);
            },
            &|r: &Path| {
                fs::create_dir_all(r.join("etc")).unwrap();
                fs::write(r.join("etc/msg"), "hello through CRI").unwrap();
                write_files_for_app(r, 2, 3);
            },
        ],
        &["--config.cmd", "/bin/sh"],
    );

    // The pull: CRI unpacks into tilefs's snapshots, one committed per
    // layer, keyed by chain id, with CRI's labels; containerd's own
    // overlayfs snapshotter gets nothing.
    rig.pull(&image);
    let chain = chain_ids(&image);
    let snaps = rig.snapshot_list();
    for (i, id) in chain.iter().enumerate() {
        let parent = if i == 0 { "" } else { chain[i - 1].as_str() };
        assert!(
            snaps
                .iter()
                .any(|(k, p, kind)| k == id && p == parent && kind == "Committed"),
            "layer {i} ({id}) is no committed tilefs snapshot: {snaps:?}"
        );
    }
    let overlayfs = ok(rig.ctr().args(["snapshots", "ls"]));
    assert_eq!(overlayfs.lines().count(), 1, "overlayfs snapshots: {overlayfs}");
    let raw = ok(Command::new("skopeo").args(["inspect", "--raw", "--tls-verify=false", &format!("docker://{image}")]));
    let manifest_digest = format!("sha256:{}", sha256_hex(raw.as_bytes()));
    let manifest: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let layer_digests: Vec<&str> = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap())
        .collect();
    // Not lazy: containerd fetched each layer, once.
    let sent = rig.registry().blobs_sent();
    for digest in &layer_digests {
        let n = sent.iter().filter(|d| d == digest).count();
        assert_eq!(n, 1, "layer {digest} sent {n} times: {sent:?}");
    }
    let records = rig.records();
    for (id, digest) in chain.iter().zip(&layer_digests) {
        let r = records
            .iter()
            // containerd names its backend's snapshots NAMESPACE/N/NAME.
            .find(|r| r["key"].as_str().is_some_and(|k| k.ends_with(&format!("/{id}"))))
            .unwrap_or_else(|| panic!("the snapshotter has no record of {id}"));
        let labels = &r["labels"];
        assert_eq!(labels["containerd.io/snapshot/cri.image-ref"], image.as_str(), "{r}");
        assert_eq!(labels["containerd.io/snapshot/cri.layer-digest"], *digest, "{r}");
        assert_eq!(labels["containerd.io/snapshot.ref"], id.as_str(), "{r}");
        assert_eq!(
            labels["containerd.io/snapshot/cri.manifest-digest"],
            manifest_digest.as_str(),
            "{r}"
        );
    }

    // A pod: its pause container runs on a kernel overlay of the chain's
    // EROFS image, which the snapshotter mounted under its root.
    let pod = rig.run_pod("web");
    let sandbox = rig.inspect("inspectp", &pod.id);
    assert_eq!(sandbox["status"]["state"], "SANDBOX_READY", "{sandbox}");
    let pause_pid = sandbox["info"]["pid"].as_i64().unwrap();
    let rootfs = area.path(&format!("cstate/io.containerd.runtime.v2.task/{NS}/{}/rootfs", pod.id));
    let line = mount_line(&rootfs).unwrap_or_else(|| panic!("the pod's rootfs is not mounted at {}", rootfs.display()));
    assert!(
        line.contains(" overlay ") && line.contains(&format!("lowerdir={}/mnt/", rig.root.display())),
        "the pod's rootfs is no overlay of the snapshotter's images: {line}"
    );

    // A container: reads the image's file, writes one of its own (into
    // its tilefs snapshot's upper directory), exits.
    let id = rig.start_container(
        &pod,
        "main",
        &image,
        "cat /etc/msg; echo; echo scribble > /written; cat /written",
    );
    assert_eq!(rig.wait_exited(&id), 0, "{}", rig.logs(&id));
    assert_eq!(rig.logs(&id), "hello through CRI\nscribble\n");
    let snaps = rig.snapshot_list();
    assert!(
        snaps
            .iter()
            .any(|(k, p, kind)| k == &id && p == chain.last().unwrap() && kind == "Active"),
        "the container's snapshot is not tilefs's: {snaps:?}"
    );
    let written: Vec<PathBuf> = fs::read_dir(rig.root.join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("fs/written"))
        .filter(|p| p.exists())
        .collect();
    assert_eq!(
        written.len(),
        1,
        "the container's write in the snapshotter's uppers: {written:?}"
    );
    assert_eq!(fs::read(&written[0]).unwrap(), b"scribble\n");

    // Stop and removal: the pause process is killed, the container's and
    // the pod's snapshots and mounts go, the image's stay.
    rig.remove_container(&id);
    let t = Instant::now();
    ok(rig.crictl().args(["stopp", &pod.id]));
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "StopPodSandbox took {:?}",
        t.elapsed()
    );
    assert_eq!(rig.inspect("inspectp", &pod.id)["status"]["state"], "SANDBOX_NOTREADY");
    wait_for("the pause process ending", Duration::from_secs(10), || {
        fs::read_to_string(format!("/proc/{pause_pid}/stat")).map_or(true, |s| {
            s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z')
        })
    });
    ok(rig.crictl().args(["rmp", &pod.id]));
    let left = rig.mounts_of(&[&pod.id, &id]);
    assert!(left.is_empty(), "still mounted after the pod's removal: {left:?}");
    let snaps = rig.snapshot_list();
    assert!(
        snaps.iter().all(|(_, _, kind)| kind == "Committed"),
        "snapshots left after the pod's removal: {snaps:?}"
    );
    let sock = rig.sock.display().to_string();
    wait_for("the pod's shims exiting", Duration::from_secs(10), || {
        CriRig::processes_naming(&sock).is_empty()
    });

    // After a restart of the snapshotter, the next pod starts from the
    // same snapshots.
    rig.settle();
    rig.restart_snapshotter();
    let logs = rig.run_pod_and_container(&image, "cat /etc/msg");
    assert_eq!(logs.trim_end(), "hello through CRI");

    // The image filesystem CRI reports (for the kubelet's image gc) is a
    // directory that exists: the store's.
    let info: serde_json::Value = serde_json::from_str(&ok(rig.crictl().args(["imagefsinfo", "-o", "json"]))).unwrap();
    let fs_path = info["status"]["imageFilesystems"][0]["fsId"]["mountpoint"]
        .as_str()
        .unwrap_or_else(|| panic!("no image filesystem: {info}"));
    assert!(Path::new(fs_path).is_dir(), "{fs_path} (imagefsinfo) is no directory");
    assert_eq!(
        fs::canonicalize(fs_path).unwrap(),
        fs::canonicalize(&rig.store).unwrap(),
        "{fs_path} is not the store"
    );

    // `crictl rmi`: containerd removes the image's snapshots and the
    // snapshotter gives the space back a second after, no `tilefs gc` run.
    let bytes_of_objects = || -> u64 {
        fs::read_dir(&rig.store)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().len() == 2)
            .flat_map(|e| fs::read_dir(e.path()).unwrap().flatten())
            .map(|o| o.metadata().unwrap().len())
            .sum()
    };
    let (held, before) = (held_images(&rig.store).len(), bytes_of_objects());
    ok(rig.crictl().args(["rmi", &image]));
    let removable = || -> u64 {
        let out = ok(Command::new(tilefs_bin())
            .args(["gc", "--dry-run", "--json", "--store"])
            .arg(&rig.store));
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["objects_removed"]
            .as_u64()
            .unwrap()
    };
    wait_for(
        "the snapshotter collecting the image's objects",
        Duration::from_secs(60),
        || held_images(&rig.store).len() < held && removable() == 0,
    );
    let after = bytes_of_objects();
    // The app's own 9 files of 16 KiB at least (busybox is the pause
    // image's too).
    assert!(
        after + 9 * (16 << 10) <= before,
        "{before} bytes of objects before, {after} after"
    );
    let log = fs::read_to_string(area.path("snapshotter.log")).unwrap();
    assert!(log.contains("snapshotter") && log.contains(": collected "), "{log}");
    drop(rig);
}

/// `n` files of 16 KiB under `root/data`, named and filled by `seed`.
#[test]
fn cri_starts_a_pod_lazily_from_a_runnable_tilefs_image() {
    let area = Area::new();
    let rig = CriRig::start(&area);
    // An ordinary image of 40 files of 256 KiB, and the runnable tilefs
    // image of it, pushed beside it.
    let plain = push_image_with(
        &area,
        rig.registry(),
        "big",
        &[&|r: &Path| {
            busybox_into(r, &["sh", "cat", "echo", "md5sum"]);
            fs::create_dir_all(r.join("etc")).unwrap();
            fs::write(r.join("etc/msg"), "hello lazily through CRI").unwrap();
            let files: Vec<(String, usize)> = (0..40).map(|i| (format!("data/f{i}"), 256 << 10)).collect();
            common::oci::write_files(r, 7, &files);
        }],
        &["--config.cmd", "/bin/sh"],
    );
    let work = area.dir("work-store");
    let tilefs_in = |args: &[&str]| {
        let mut c = Command::new(tilefs_bin());
        c.args(args).arg("--store").arg(&work);
        ok(&mut c)
    };
    tilefs_in(&[
        "pull",
        "-q",
        "--tls-verify=false",
        "--tag",
        "big",
        &format!("docker://{plain}"),
    ]);
    let lazy = format!("{}/tilefs/big:lazy", rig.registry_addr());
    tilefs_in(&[
        "push",
        "-q",
        "--tls-verify=false",
        "--runnable-from",
        &format!("docker://{plain}"),
        "big",
        &format!("docker://{lazy}"),
    ]);
    let raw = common::oci::skopeo_raw(&format!("docker://{lazy}"));
    let pack = raw["layers"].as_array().unwrap().last().unwrap().clone();
    let (pack, pack_size) = (
        pack["digest"].as_str().unwrap().to_string(),
        pack["size"].as_u64().unwrap(),
    );
    let want_md5 = {
        let out = ok(Command::new("md5sum").arg(area.path("bundle-big/rootfs/data/f3")));
        out.split_whitespace().next().unwrap().to_string()
    };

    // The pull downloads no layer: each is a committed tilefs snapshot,
    // made lazily.
    let from = rig.registry().requests().len();
    let t = Instant::now();
    rig.pull(&lazy);
    let pulled = t.elapsed();
    let pack_bytes = |from: usize| -> u64 {
        rig.registry().requests()[from..]
            .iter()
            .filter(|r| r.method == "GET" && r.path.ends_with(&pack))
            .map(|r| r.bytes)
            .sum()
    };
    assert_eq!(pack_bytes(from), 0, "the pull downloaded the image's files");
    let chain = chain_ids(&lazy);
    let snaps = rig.snapshot_list();
    for id in &chain {
        assert!(
            snaps.iter().any(|(k, _, kind)| k == id && kind == "Committed"),
            "{id} is no committed snapshot: {snaps:?}"
        );
    }
    let records = rig.records();
    assert!(
        chain.iter().all(|id| records
            .iter()
            .any(|r| r["labels"]["containerd.io/snapshot.ref"] == id.as_str() && r["lazy"] == true)),
        "{records:?}"
    );

    // A pod runs from it: the files it reads are fetched, no others.
    let from = rig.registry().requests().len();
    let t = Instant::now();
    let out = rig.run_pod_and_container(
        &lazy,
        "cat /etc/msg; echo; md5sum /data/f3; echo mine > /etc/new; cat /etc/new",
    );
    eprintln!(
        "lazy through CRI: pull {:.2} s, pod run to its end {:.2} s",
        pulled.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    assert!(out.starts_with("hello lazily through CRI\n"), "{out}");
    assert!(out.contains(&want_md5), "{out}");
    assert!(out.trim_end().ends_with("mine"), "{out}");
    let fetched = pack_bytes(from);
    assert!(
        fetched > 0 && fetched < pack_size / 4,
        "{fetched} of the pack's {pack_size} bytes fetched for a few files"
    );
    // Its root is a kernel overlay (issue 45), every file as pushed.
    let out = rig.run_pod_and_container(&lazy, &format!("{ROOT_MOUNT}; cd /data && md5sum *"));
    assert_kernel_root(&rig, &out);
    assert_same_md5s(&out, &area.path("bundle-big/rootfs/data"));
}

/// A container's command that prints its root's mount table line.
const ROOT_MOUNT: &str = "grep ' / / ' /proc/self/mountinfo";

/// What a container's [`ROOT_MOUNT`] printed says its root is, in a
/// container started lazily where the store takes fanotify pre-content
/// marks: a kernel overlay over the lazy image's EROFS mount with the store
/// as its data-only lower (issue 45), not over a FUSE server's mount.
fn assert_kernel_root(rig: &CriRig, out: &str) {
    let line = out
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/"))
        .unwrap_or_else(|| panic!("no root mount in {out}"));
    eprintln!("a lazy container's root: {line}");
    let fields: Vec<&str> = line.split(" - ").nth(1).unwrap().split(' ').collect();
    assert_eq!(fields[0], "overlay", "{line}");
    let lower = fields[2]
        .split(',')
        .find_map(|o| o.strip_prefix("lowerdir="))
        .unwrap_or_else(|| panic!("no lowerdir: {line}"));
    let (lowers, store) = lower
        .split_once("::")
        .unwrap_or_else(|| panic!("no data-only lower: {line}"));
    assert_eq!(Path::new(store), fs::canonicalize(&rig.store).unwrap(), "{line}");
    // The image's mount: the lowest of the others.
    let image = lowers.rsplit(':').next().unwrap();
    let host = mount_line(Path::new(image)).unwrap_or_else(|| panic!("nothing mounted at {image}"));
    let fstype = host.split(" - ").nth(1).unwrap().split(' ').next().unwrap();
    assert_eq!(fstype, "erofs", "{host}");
}

/// `out` holds `md5sum *` of the directory `dir` as it is here.
fn assert_same_md5s(out: &str, dir: &Path) {
    let want = ok(Command::new("sh").arg("-c").arg("md5sum *").current_dir(dir));
    assert!(out.contains(&want), "{out}\nwanted:\n{want}");
}

fn write_files_for_app(root: &Path, seed: u64, n: usize) {
    let files: Vec<(String, usize)> = (0..n).map(|i| (format!("data/l{seed}-{i}"), 16 << 10)).collect();
    common::oci::write_files(root, seed, &files);
}

/// A Prepare through containerd's own snapshots API in namespace `ns`, as
/// the unpacker of any containerd client there makes it (CRI's labels
/// included): Ok, or the error's code and message.
fn prepare_in_namespace(
    sock: &Path,
    ns: &str,
    key: &str,
    parent: &str,
    labels: std::collections::HashMap<String, String>,
) -> Result<(), (tonic::Code, String)> {
    use containerd_snapshots::api::snapshots::v1::snapshots_client::SnapshotsClient;
    use containerd_snapshots::api::snapshots::v1::PrepareSnapshotRequest;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let sock = sock.to_path_buf();
    rt.block_on(async move {
        let ch = tonic::transport::Endpoint::try_from("http://containerd")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_| {
                tokio::net::UnixStream::connect(sock.clone())
            }))
            .await
            .unwrap();
        let mut r = tonic::Request::new(PrepareSnapshotRequest {
            snapshotter: "tilefs".into(),
            key: key.into(),
            parent: parent.into(),
            labels,
        });
        r.metadata_mut().insert("containerd-namespace", ns.parse().unwrap());
        SnapshotsClient::new(ch)
            .prepare(r)
            .await
            .map(drop)
            .map_err(|s| (s.code(), s.message().to_string()))
    })
}

/// Issue 43: a lazy snapshot belongs to its image reference. One runnable
/// artifact is in two repositories, `evil` (which pushed it first and was
/// served lazily first, in another containerd namespace) and `good`. CRI's
/// pull of `good` is checked in `good`'s registry under its own signature
/// policy (a policy that rejects it makes the pull fail, not fall back on
/// `evil`'s snapshot), and once accepted its pod reads files fetched from
/// `good` alone: `evil`'s access log shows nothing of them.
#[test]
fn cri_lazy_snapshots_are_each_references_own() {
    let area = Area::new();
    let policy = area.path("policy.json");
    let write_policy = |reject_good: Option<&str>| {
        let mut p = serde_json::json!({"default": [{"type": "insecureAcceptAnything"}]});
        if let Some(repo) = reject_good {
            p["transports"] = serde_json::json!({"docker": {repo: [{"type": "reject"}]}});
        }
        fs::write(&policy, p.to_string()).unwrap();
    };
    write_policy(None);
    let rig = CriRig::start_with(&area, &["--signature-policy", policy.to_str().unwrap()]);
    let plain = push_image_with(
        &area,
        rig.registry(),
        "plain",
        &[&|r: &Path| {
            busybox_into(r, &["sh", "cat", "md5sum"]);
            let files: Vec<(String, usize)> = (0..16).map(|i| (format!("data/f{i}"), 256 << 10)).collect();
            common::oci::write_files(r, 11, &files);
        }],
        &["--config.cmd", "/bin/sh"],
    );
    let work = area.dir("work-store");
    let tilefs_in = |args: &[&str]| {
        let mut c = Command::new(tilefs_bin());
        c.args(args).arg("--store").arg(&work);
        ok(&mut c)
    };
    tilefs_in(&[
        "pull",
        "-q",
        "--tls-verify=false",
        "--tag",
        "app",
        &format!("docker://{plain}"),
    ]);
    let reg = rig.registry_addr().to_string();
    let (evil, good) = (format!("{reg}/evil/app:lazy"), format!("{reg}/good/app:lazy"));
    for r in [&evil, &good] {
        tilefs_in(&[
            "push",
            "-q",
            "--tls-verify=false",
            "--runnable-from",
            &format!("docker://{plain}"),
            "app",
            &format!("docker://{r}"),
        ]);
    }
    let raw = common::oci::skopeo_raw(&format!("docker://{evil}"));
    assert_eq!(
        raw,
        common::oci::skopeo_raw(&format!("docker://{good}")),
        "one artifact"
    );
    let layers: Vec<String> = raw["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect();
    let pack = layers.last().unwrap().clone();
    let chain = chain_ids(&evil);
    let manifest = format!(
        "sha256:{}",
        sha256_hex(
            &Command::new("skopeo")
                .args(["inspect", "--raw", "--tls-verify=false", &format!("docker://{evil}")])
                .output()
                .unwrap()
                .stdout
        )
    );

    // `evil` first, in namespace "evil": each layer is made lazily there,
    // as containerd's unpacker asks (AlreadyExists: the snapshot is made).
    for (i, layer) in layers.iter().enumerate() {
        let labels = [
            ("containerd.io/snapshot.ref", chain[i].as_str()),
            ("containerd.io/snapshot/cri.image-ref", evil.as_str()),
            ("containerd.io/snapshot/cri.manifest-digest", manifest.as_str()),
            ("containerd.io/snapshot/cri.layer-digest", layer.as_str()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let parent = if i == 0 { "" } else { chain[i - 1].as_str() };
        let got = prepare_in_namespace(&area.path("c.sock"), "evil", &format!("extract-{i}"), parent, labels);
        assert_eq!(
            got.as_ref().map_err(|e| e.0),
            Err(tonic::Code::AlreadyExists),
            "{got:?}"
        );
    }
    let log = || fs::read_to_string(area.path("snapshotter.log")).unwrap_or_default();
    assert!(
        log().contains("/evil/app@") && log().contains("made lazily"),
        "{}",
        log()
    );

    // A policy that rejects `good`: its pull fails (its layers are no
    // tar), rather than taking `evil`'s snapshots.
    write_policy(Some(&format!("{reg}/good")));
    let refused = run(rig.crictl().args(["pull", &good]));
    assert!(
        !refused.status.success(),
        "a pull the policy rejects succeeded: {}",
        log()
    );
    assert!(
        log().contains("not served lazily") && log().contains("good/app"),
        "{}",
        log()
    );

    // Accepted: the pull is lazy (the pack is not downloaded), from
    // `good`; the pod's reads are fetched from `good`, none from `evil`.
    write_policy(None);
    let from = rig.registry().requests().len();
    rig.pull(&good);
    assert!(
        rig.registry().requests()[from..]
            .iter()
            .all(|r| !(r.method == "GET" && r.path.ends_with(&pack))),
        "the pull downloaded the pack"
    );
    let out = rig.run_pod_and_container(&good, "md5sum /data/f3");
    let want = ok(Command::new("md5sum").arg(area.path("bundle-plain/rootfs/data/f3")));
    assert_eq!(out.split_whitespace().next(), want.split_whitespace().next(), "{out}");
    let since = &rig.registry().requests()[from..];
    let to_evil: Vec<&str> = since
        .iter()
        .filter(|r| r.path.contains("/evil/"))
        .map(|r| r.path.as_str())
        .collect();
    assert!(
        to_evil.is_empty(),
        "the victim's pull or reads went to evil: {to_evil:?}"
    );
    assert!(
        since
            .iter()
            .any(|r| r.path.starts_with("/v2/good/app/blobs/") && r.path.ends_with(&pack)),
        "no file was fetched from good"
    );
    let records = rig.records();
    assert!(
        records
            .iter()
            .any(|r| r["lazy"] == true && r["key"].as_str().is_some_and(|k| k.contains("/good/app@"))),
        "{records:?}"
    );
}

/// A runnable tilefs image of an ordinary one (busybox and 24 files of
/// 256 KiB), pushed as `dst` (`ADDR/REPO:TAG`) by `tilefs` with `envs`:
/// returns the digest of its pack.
fn push_runnable(area: &Area, rig: &CriRig, name: &str, dst: &str, envs: &[(&str, &Path)]) -> String {
    let plain = push_image_with(
        area,
        rig.registry(),
        name,
        &[&|r: &Path| {
            busybox_into(r, &["sh", "cat", "md5sum"]);
            fs::create_dir_all(r.join("etc")).unwrap();
            fs::write(r.join("etc/msg"), format!("hello from {name}")).unwrap();
            let files: Vec<(String, usize)> = (0..24).map(|i| (format!("data/f{i}"), 256 << 10)).collect();
            // Each image its own contents: no file of one is already in
            // the store when the other is read.
            let seed = name
                .bytes()
                .fold(11u64, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
            common::oci::write_files(r, seed, &files);
        }],
        &["--config.cmd", "/bin/sh"],
    );
    let work = area.dir(&format!("work-{name}"));
    let tilefs = |args: &[&str]| {
        let mut c = Command::new(tilefs_bin());
        c.args(args).arg("--store").arg(&work);
        for (k, v) in envs {
            c.env(k, v);
        }
        ok(&mut c)
    };
    let src = format!("docker://{plain}");
    tilefs(&["pull", "-q", "--tls-verify=false", "--tag", name, &src]);
    tilefs(&[
        "push",
        "-q",
        "--tls-verify=false",
        "--runnable-from",
        &src,
        name,
        &format!("docker://{dst}"),
    ]);
    let manifest = {
        let mut c = Command::new("skopeo");
        c.args(["inspect", "--raw", "--tls-verify=false"]);
        for (k, v) in envs {
            c.env(k, v);
        }
        serde_json::from_str::<serde_json::Value>(&ok(c.arg(format!("docker://{dst}")))).unwrap()
    };
    manifest["layers"].as_array().unwrap().last().unwrap()["digest"]
        .as_str()
        .unwrap()
        .to_string()
}

/// What the snapshotter's fetches asked of `registry` for `pack` since
/// request `from`: (range GETs answered, `GET /v2/` requests).
fn lazy_requests(registry: &Registry, from: usize, pack: &str) -> (usize, usize) {
    let reqs = registry.requests();
    let ours = reqs[from..].iter().filter(|r| r.agent.starts_with("tilefs/"));
    let (mut ranges, mut pings) = (0, 0);
    for r in ours {
        // A pull-through mirror answers a range of a blob it has not cached
        // yet with the whole blob streamed from upstream; the reader hangs
        // up once it has its range, and the registry logs that as a 500
        // after the bytes went out. Bytes sent are what counts.
        let served = matches!(r.status, 200 | 206) || (r.status == 500 && r.bytes > 0);
        if r.method == "GET" && r.path.contains(pack) && served {
            ranges += 1;
        }
        if r.method == "GET" && r.path == "/v2/" {
            pings += 1;
        }
    }
    (ranges, pings)
}

/// Kubernetes' way to the lazy path: the pull secret a pull carries reaches
/// the snapshotter through its CRI image service proxy (`[cri_keychain]`),
/// and containerd's hosts.toml (`[registry] config_path`) sends its fetches
/// to a mirror, both configured in the snapshotter's `--config`.
#[test]
fn cri_credentials_and_mirrors_reach_the_lazy_path() {
    let area = Area::new();
    let auth = area.path("auth.json");
    let secured = Registry::start_named_with_password(&area, "secured", "alice", "s3cret", &auth);
    let hosts = area.dir("hosts.d");
    let config = area.path("snapshotter.toml");
    fs::write(
        &config,
        format!(
            "[cri_keychain]\nenable_keychain = true\nimage_service_path = \"{}\"\n[registry]\nconfig_path = \"{}\"\n",
            area.path("c.sock").display(),
            hosts.display()
        ),
    )
    .unwrap();
    let rig = CriRig::start_opts(&area, &["--config", config.to_str().unwrap()], &[&secured.addr]);

    // Credentials: the runnable image in the registry that wants them.
    let private = format!("{}/team/app:lazy", secured.addr);
    let pack = push_runnable(&area, &rig, "private", &private, &[("REGISTRY_AUTH_FILE", &auth)]);

    // Without the secret, the pull fails, and crictl says why.
    let out = run(rig.crictl_via_snapshotter().args(["pull", &private]));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "pulled without credentials");
    eprintln!("without credentials, crictl says: {}", said.trim());
    assert!(
        said.contains("401") || said.to_lowercase().contains("unauthorized"),
        "{said}"
    );

    // With it, through the proxy: the lazy path fetches with it.
    let from = secured.requests().len();
    ok(rig
        .crictl_via_snapshotter()
        .args(["pull", "--creds", "alice:s3cret", &private]));
    let records = rig.records();
    assert!(
        records.iter().any(|r| r["lazy"] == true),
        "no lazy snapshot: {records:?}\n{}",
        fs::read_to_string(area.path("snapshotter.log")).unwrap_or_default()
    );
    let at_run = secured.requests().len();
    // Files read out of order: a fetch each.
    let out = rig.run_pod_and_container(
        &private,
        "cat /etc/msg; echo; for i in 21 17 13 9 5 1; do md5sum /data/f$i; done",
    );
    assert!(out.starts_with("hello from private\n"), "{out}");
    let (ranges, pings) = lazy_requests(&secured, at_run, &pack);
    eprintln!("secured registry, pod run: {ranges} range GETs of the pack, {pings} GET /v2/");
    assert!(ranges > 0, "the files came from nowhere");
    assert!(pings <= 1, "{pings} GET /v2/ for {ranges} range GETs");
    let refused = secured.requests()[from..]
        .iter()
        .filter(|r| r.agent.starts_with("tilefs/") && r.status == 401 && r.path != "/v2/")
        .count();
    assert_eq!(refused, 0, "the snapshotter's requests were refused");

    // A pull-through mirror of the rig's registry, named in hosts.toml.
    let upstream = rig.registry_addr().to_string();
    let mirror = Registry::start_named(&area, "mirror", &format!("proxy:\n  remoteurl: http://{upstream}\n"));
    let dir = hosts.join(&upstream);
    fs::create_dir_all(&dir).unwrap();
    fs::write(
        dir.join("hosts.toml"),
        format!(
            "server = \"http://{upstream}\"\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            mirror.addr
        ),
    )
    .unwrap();
    let public = format!("{upstream}/team/pub:lazy");
    let pack = push_runnable(&area, &rig, "public", &public, &[]);
    let from = rig.registry().requests().len();
    rig.pull(&public);
    let out = rig.run_pod_and_container(&public, "cat /etc/msg; echo; md5sum /data/f1 /data/f2 /data/f3");
    assert!(out.starts_with("hello from public\n"), "{out}");
    let (via_mirror, pings) = lazy_requests(&mirror, 0, &pack);
    let (direct, _) = lazy_requests(rig.registry(), from, &pack);
    eprintln!("mirror: {via_mirror} GETs of the pack by tilefs ({pings} GET /v2/), upstream: {direct}");
    assert!(via_mirror > 0, "the mirror served no fetch");
    assert_eq!(direct, 0, "the snapshotter fetched from the upstream registry");

    // A mirror that is down is passed over: the registry itself serves.
    let mut mirror = mirror;
    mirror.stop();
    let from = rig.registry().requests().len();
    let out = rig.run_pod_and_container(&public, "md5sum /data/f20");
    assert!(out.contains("/data/f20"), "{out}");
    let (direct, _) = lazy_requests(rig.registry(), from, &pack);
    assert!(direct > 0, "the file came from nowhere");
}

/// The snapshotter's `--config` refuses what it does not know, naming the
/// file and the key.
#[test]
fn snapshotter_config_mistakes_are_named() {
    let area = Area::new();
    let cfg = area.path("snap.toml");
    for (text, said) in [
        ("gc = false\ntls_verify = \"yes\"\n", "line 2"),
        (
            "[cri_keychain]\nenable_keychain = true\nimage_socket = \"/x\"\n",
            "image_socket",
        ),
        ("[registry]\nconfig_dir = \"/x\"\n", "config_dir"),
    ] {
        fs::write(&cfg, text).unwrap();
        let out = run(Command::new(tilefs_bin())
            .arg("snapshotter")
            .arg("--config")
            .arg(&cfg)
            .arg("--socket")
            .arg(area.path("s.sock"))
            .arg("--root")
            .arg(area.path("root"))
            .arg("--store")
            .arg(area.path("store")));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text}: accepted");
        assert!(err.contains("snap.toml") && err.contains(said), "{text}: {err}");
    }
}

/// Issue 44: an ordinary gzip image with a `tilefs index` starts lazily
/// through CRI (its layers' chains made from the index's layer maps, its
/// files fetched by range from the ordinary layer blobs and checked before
/// a byte is served); the same kind of image without an index is pulled
/// whole and runs; a layer blob whose bytes the registry changed fails the
/// read of the file they belong to, and other files read. What became of
/// each image reaches crictl (`inspecti`: info `tilefs`), and a pull the
/// snapshotter's signature policy refuses fails with the policy's reason.
#[test]
fn cri_starts_an_ordinary_image_lazily_through_its_index() {
    let area = Area::new();
    let policy = area.path("policy.json");
    let write_policy = |reject: Option<&str>| {
        let mut p = serde_json::json!({"default": [{"type": "insecureAcceptAnything"}]});
        if let Some(repo) = reject {
            p["transports"] = serde_json::json!({"docker": {repo: [{"type": "reject"}]}});
        }
        fs::write(&policy, p.to_string()).unwrap();
    };
    write_policy(None);
    let config = area.path("snapshotter.toml");
    fs::write(
        &config,
        format!(
            "signature_policy = \"{}\"\n[cri_keychain]\nenable_keychain = true\nimage_service_path = \"{}\"\n",
            policy.display(),
            area.path("c.sock").display()
        ),
    )
    .unwrap();
    let rig = CriRig::start_with(&area, &["--config", config.to_str().unwrap()]);
    // Three gzip layers (umoci's): busybox (shorter than a checkpoint's
    // span: fetched whole on first use), 24 files of 256 KiB (a checkpoint
    // about every 4 MiB), one file of 8 MiB alone (the largest blob).
    let indexed = push_image_with(
        &area,
        rig.registry(),
        "indexed",
        &[
            &|r: &Path| {
                busybox_into(r, &["sh", "cat", "echo", "md5sum"]);
                fs::create_dir_all(r.join("etc")).unwrap();
                fs::write(r.join("etc/msg"), "hello from an ordinary image").unwrap();
            },
            &|r: &Path| {
                let files: Vec<(String, usize)> = (0..24).map(|i| (format!("data/f{i}"), 256 << 10)).collect();
                common::oci::write_files(r, 31, &files);
            },
            &|r: &Path| common::oci::write_files(r, 32, &[("big/lone".to_string(), 8 << 20)]),
        ],
        &["--config.cmd", "/bin/sh"],
    );
    let md5 = |rel: &str| {
        let out = ok(Command::new("md5sum").arg(area.path(&format!("bundle-indexed/rootfs/{rel}"))));
        out.split_whitespace().next().unwrap().to_string()
    };
    let out = ok(Command::new(tilefs_bin())
        .args(["index", "--json", "--tls-verify=false", "--store"])
        .arg(area.path("indexing"))
        .arg(format!("docker://{indexed}")));
    let ix: serde_json::Value = serde_json::from_str(&out).unwrap();
    let index = ix["manifest_digest"].as_str().unwrap().to_string();
    let raw = common::oci::skopeo_raw(&format!("docker://{indexed}"));
    let layers: Vec<(String, u64)> = raw["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["digest"].as_str().unwrap().to_string(), l["size"].as_u64().unwrap()))
        .collect();
    // The layer blob GETs since request `from`: (status, bytes) each.
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
    // crictl shows each key of ImageStatus's info at the top.
    let inspecti = |image: &str| -> (bool, String) {
        let out = ok(rig.crictl_via_snapshotter().args(["inspecti", "-o", "json", image]));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let said = &v["tilefs"];
        match (said["lazy"].as_bool(), said["message"].as_str()) {
            (Some(lazy), Some(m)) => (lazy, m.to_string()),
            _ => panic!("inspecti says nothing of tilefs: {out}"),
        }
    };

    // The pull, through the snapshotter's image service: no layer blob
    // is fetched; every layer is a lazy snapshot.
    let from = rig.registry().requests().len();
    let t = Instant::now();
    ok(rig.crictl_via_snapshotter().args(["pull", &indexed]));
    let pulled = t.elapsed();
    assert_eq!(layer_gets(from), [], "the pull fetched layer blobs");
    let chain = chain_ids(&indexed);
    let records = rig.records();
    for id in &chain {
        assert!(
            records
                .iter()
                .any(|r| r["labels"]["containerd.io/snapshot.ref"] == id.as_str()
                    && r["lazy"] == true
                    && r["indexed"] == true),
            "{id} was not made lazily: {records:?}\n{}",
            fs::read_to_string(area.path("snapshotter.log")).unwrap_or_default()
        );
    }
    let (lazy, said) = inspecti(&indexed);
    eprintln!("crictl inspecti of the indexed image: {said}");
    assert!(
        lazy && said.starts_with("lazy: through tilefs index") && said.contains(&index),
        "{said}"
    );

    // A pod reads a file of the data layer (the last in its tar stream):
    // range GETs of that layer's blob, a part of it from the checkpoint
    // before the file; the big file's layer is not fetched.
    let from = rig.registry().requests().len();
    let t = Instant::now();
    let out = rig.run_pod_and_container(&indexed, "cat /etc/msg; echo; md5sum /data/f9");
    eprintln!(
        "indexed image through CRI: pull {:.2} s, pod run to its end {:.2} s",
        pulled.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    assert!(out.starts_with("hello from an ordinary image\n"), "{out}");
    assert!(out.contains(&md5("data/f9")), "{out}");
    let gets = layer_gets(from);
    let (data, data_size) = &layers[1];
    let of_data: Vec<_> = gets.iter().filter(|g| &g.0 == data).collect();
    let fetched: u64 = of_data.iter().map(|g| g.2).sum();
    eprintln!("pod on the indexed image: layer blob GETs {gets:?}; {fetched} of the data layer's {data_size} bytes");
    assert!(!of_data.is_empty(), "the file came from nowhere: {gets:?}");
    assert!(
        of_data.iter().all(|g| g.1 == 206),
        "whole-blob GETs of the data layer: {gets:?}"
    );
    assert!(fetched * 2 < *data_size, "{fetched} bytes of a layer of {data_size}");
    assert!(
        gets.iter().all(|g| g.0 != layers[2].0),
        "the big file's layer was fetched: {gets:?}"
    );
    // Its root is a kernel overlay (issue 45), every file as pushed.
    let out = rig.run_pod_and_container(&indexed, &format!("{ROOT_MOUNT}; cd /data && md5sum *"));
    assert_kernel_root(&rig, &out);
    assert_same_md5s(&out, &area.path("bundle-indexed/rootfs/data"));

    // The registry's copy of the big file's layer changes a byte: its read
    // fails, the other files read.
    let tampered = rig.registry().tamper_largest_blob();
    assert_eq!(tampered, layers[2].0, "the largest blob is the big file's layer");
    let out = rig.run_pod_and_container(
        &indexed,
        "md5sum /data/f1; if cat /big/lone > /dev/null; then echo big read; else echo big failed; fi",
    );
    assert!(out.contains(&md5("data/f1")), "{out}");
    assert!(out.contains("big failed") && !out.contains("big read"), "{out}");

    // Without an index: pulled whole (containerd fetches each layer
    // blob), and the pod runs; crictl is told why.
    let plain = push_image_with(
        &area,
        rig.registry(),
        "plain",
        &[&|r: &Path| {
            busybox_into(r, &["sh", "cat"]);
            fs::create_dir_all(r.join("etc")).unwrap();
            fs::write(r.join("etc/msg"), "hello unindexed").unwrap();
        }],
        &["--config.cmd", "/bin/sh"],
    );
    let plain_layer = common::oci::skopeo_raw(&format!("docker://{plain}"))["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let from = rig.registry().requests().len();
    ok(rig.crictl_via_snapshotter().args(["pull", &plain]));
    let whole = rig.registry().requests()[from..]
        .iter()
        .filter(|r| r.method == "GET" && r.path.ends_with(&plain_layer) && r.status == 200)
        .count();
    assert_eq!(whole, 1, "the unindexed image's layer was not fetched whole");
    let (lazy, said) = inspecti(&plain);
    eprintln!("crictl inspecti of the unindexed image: {said}");
    assert!(
        !lazy && said.starts_with("pulled whole:") && said.contains("has no tilefs index"),
        "{said}"
    );
    let out = rig.run_pod_and_container(&plain, "cat /etc/msg");
    assert_eq!(out.trim_end(), "hello unindexed");
    let log = fs::read_to_string(area.path("snapshotter.log")).unwrap();
    assert!(
        log.contains("not served lazily") && log.contains("has no tilefs index"),
        "{log}"
    );

    // The snapshotter's policy refuses the image now: the pull fails, and
    // crictl says the policy's reason.
    write_policy(Some(&format!("{}/tilefs/plain", rig.registry_addr())));
    let out = run(rig.crictl_via_snapshotter().args(["pull", &plain]));
    let said = String::from_utf8_lossy(&out.stderr);
    eprintln!("a pull the policy refuses, crictl says: {}", said.trim());
    assert!(!out.status.success(), "a pull the policy refuses succeeded");
    assert!(said.contains("signature policy refuses it"), "{said}");
}

#[test]
fn cri_starts_an_estargz_image_lazily_through_its_tables_of_contents() {
    let area = Area::new();
    let Some(generator) = common::seekable::generator() else {
        return;
    };
    let policy = area.path("policy.json");
    fs::write(&policy, r#"{"default": [{"type": "insecureAcceptAnything"}]}"#).unwrap();
    let config = area.path("snapshotter.toml");
    fs::write(
        &config,
        format!(
            "signature_policy = \"{}\"\n[cri_keychain]\nenable_keychain = true\nimage_service_path = \"{}\"\n",
            policy.display(),
            area.path("c.sock").display()
        ),
    )
    .unwrap();
    let rig = CriRig::start_with(&area, &["--config", config.to_str().unwrap()]);
    // Two eStargz layers, no tilefs index: busybox, and 16 files of 256
    // KiB.
    let image = common::seekable::push_seekable(
        &generator,
        &area,
        rig.registry(),
        "estargz",
        "estargz",
        &[
            &|r: &Path| {
                busybox_into(r, &["sh", "cat", "echo", "md5sum"]);
                fs::create_dir_all(r.join("etc")).unwrap();
                fs::write(r.join("etc/msg"), "hello from an eStargz image").unwrap();
            },
            &|r: &Path| {
                let files: Vec<(String, usize)> = (0..16).map(|i| (format!("data/f{i}"), 256 << 10)).collect();
                common::oci::write_files(r, 41, &files);
            },
        ],
        false,
    );
    let raw = common::oci::skopeo_raw(&format!("docker://{image}"));
    let layers: Vec<(String, u64)> = raw["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["digest"].as_str().unwrap().to_string(), l["size"].as_u64().unwrap()))
        .collect();
    // The layer blob GETs since request `from`: (blob, status, bytes).
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

    // The pull reads the tables of contents only (range GETs); every
    // layer is a lazy snapshot, and crictl says how it is served.
    let from = rig.registry().requests().len();
    ok(rig.crictl_via_snapshotter().args(["pull", &image]));
    let gets = layer_gets(from);
    assert!(gets.iter().all(|g| g.1 == 206), "whole-blob GETs by the pull: {gets:?}");
    let records = rig.records();
    for id in chain_ids(&image) {
        assert!(
            records
                .iter()
                .any(|r| r["labels"]["containerd.io/snapshot.ref"] == id.as_str() && r["lazy"] == true),
            "{id} was not made lazily: {records:?}\n{}",
            fs::read_to_string(area.path("snapshotter.log")).unwrap_or_default()
        );
    }
    let out = ok(rig.crictl_via_snapshotter().args(["inspecti", "-o", "json", &image]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let said = v["tilefs"]["message"].as_str().unwrap_or_default();
    assert_eq!(v["tilefs"]["lazy"], true, "{out}");
    assert!(
        said.starts_with("lazy: through its eStargz tables of contents"),
        "{said}"
    );

    // A pod reads a file of the data layer: range GETs of a part of it.
    let from = rig.registry().requests().len();
    let out = rig.run_pod_and_container(&image, "cat /etc/msg; echo; md5sum /data/f9");
    let md5 = ok(Command::new("md5sum").arg(area.path("estargz-tree1/data/f9")));
    assert!(out.starts_with("hello from an eStargz image\n"), "{out}");
    assert!(out.contains(md5.split_whitespace().next().unwrap()), "{out}");
    let gets = layer_gets(from);
    let (data, data_size) = &layers[1];
    let of_data: Vec<_> = gets.iter().filter(|g| &g.0 == data).collect();
    let fetched: u64 = of_data.iter().map(|g| g.2).sum();
    eprintln!("pod on the eStargz image: layer blob GETs {gets:?}; {fetched} of the data layer's {data_size} bytes");
    assert!(!of_data.is_empty(), "the file came from nowhere: {gets:?}");
    assert!(gets.iter().all(|g| g.1 == 206), "whole-blob GETs: {gets:?}");
    assert!(fetched * 2 < *data_size, "{fetched} bytes of a layer of {data_size}");
}
