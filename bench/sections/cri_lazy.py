"""Section cri_lazy: lazy starts through containerd's CRI plugin, from
`crictl pull` to a container's first output, in six configurations: the
tilefs snapshotter on an ordinary gzip image with a `tilefs index` (served
by the kernel where the work directory's filesystem takes fanotify
pre-content marks, and again with --lazy-fuse, by FUSE), SOCI
on the same image with its own index (v2, `soci convert --standalone`),
stargz-snapshotter on the image's eStargz conversion, the tilefs
snapshotter on that eStargz image, and containerd's overlayfs snapshotter
pulling the ordinary image whole.

The image: this machine's /usr/share, /usr/include and /usr/bin (BENCH_TREE,
when set, instead), with /usr/lib/os-release, in three gzip'd layers (the
trees' top-level entries split in three), a layer of generated files
(seeded pseudo-random bytes) bringing the compressed layers to
BENCH_CRI_IMAGE_MB (1000), and busybox, pushed as an ordinary OCI image to
Debian's docker-registry on a free 127.0.0.1 port (plain HTTP, access log
on). From it, untimed: `tilefs index`; `soci convert --standalone` copied
in by skopeo (tag :soci); the eStargz conversion (bench/stargz:
`stargz-convert`, estargz.Build's defaults) copied in by skopeo (:esgz).
Each run starts from nothing: a fresh containerd (Debian's, CRI plugin on,
the configuration's snapshotter as its proxy plugin and CRI's snapshotter,
snapshot annotations on) with a fresh snapshotter, both on new
directories, and the pods' sandbox image pulled (untimed). Timed: `crictl
pull` of the image, `crictl runp` of a host-network pod, `crictl create` +
`start` of a container running `cat /usr/lib/os-release`, until its output
is in the container's log file (the file `crictl logs` reads). After each
run the pod is stopped and removed, containerd and the snapshotter are
stopped, their mounts taken down and their directories removed. Rows: the
times (goals: tilefs <= 1 s, <= SOCI, <= stargz-snapshotter, and on the
eStargz image <= stargz-snapshotter), the blob bytes the registry sent
from the pull's start to the first output (access log; goal tilefs <=
SOCI), the index sizes (goal: the tilefs index <= 5% of the compressed
image). The peers: bench/stargz/build.sh and bench/soci/build.sh build them
(see their README.md); without one the others are measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402
from containers import Layout, Registry, kill9, remove_cgroup, sh, stage_image, terminate, unmount_below, wait_for  # noqa: E402

NAME = "cri_lazy"
TITLE = "lazy starts through CRI: tilefs snapshotter vs SOCI, stargz-snapshotter and overlayfs"
ORDER = 39
TREES = ["usr/share", "usr/include", "usr/bin"]
FIRST_FILE = "usr/lib/os-release"
GOAL_RATIO = 1.0
GOAL_S = 1.0
NS = "k8s.io"
CGROUP = "tilefs-bench-cri-lazy"
# The tilefs snapshotter's log line for each layer it makes lazily.
MADE_LAZILY = re.compile(r"tilefs snapshotter: .* made lazily.* \(([0-9.]+) s\)$")
# How long the timed script waits for the container's output.
OUTPUT_WAIT_S = 120


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class Peer:
    """One configuration measured: a snapshotter (None: containerd's own
    overlayfs) and the image it starts."""

    def __init__(self, key: str, label: str, snapshotter: str, image: str, serve=None, exports=None):
        self.key = key
        self.label = label
        self.name = snapshotter  # the proxy plugin's name, CRI's snapshotter
        self.image = image
        self.serve = serve  # (root, socket) -> argv; None: a snapshotter built into containerd
        self.exports = exports or (lambda root: {})  # the proxy plugin's exports


class Rig:
    """A containerd with the CRI plugin on one peer's snapshotter, in a fresh
    directory: start() before a run, stop() after it (also on failure)."""

    def __init__(self, base: Path, registry: Registry):
        self.base = base
        self.registry = registry
        self.pause = ""
        self.dir: Path | None = None
        self.peer: Peer | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.runs = 0

    def path(self, rel: str) -> Path:
        return self.dir / rel

    def crictl(self, *args, timeout: str = "300s") -> list:
        endpoint = f"unix://{self.path('c.sock')}"
        return ["crictl", "--config", self.path("crictl.yaml"), "--runtime-endpoint", endpoint,
                "--image-endpoint", endpoint, "--timeout", timeout, *args]

    def proxy_plugin(self) -> str:
        if self.peer.serve is None:
            return ""
        exports = "".join(f'    {k} = "{v}"\n' for k, v in self.peer.exports(self.path("snap")).items())
        return (f'[proxy_plugins]\n  [proxy_plugins.{self.peer.name}]\n    type = "snapshot"\n'
                f'    address = "{self.path("s.sock")}"\n'
                + (f"  [proxy_plugins.{self.peer.name}.exports]\n{exports}" if exports else ""))

    def containerd_config(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        p = self.path
        return f"""version = 2
root = "{p('croot')}"
state = "{p('cstate')}"
[grpc]
  address = "{p('c.sock')}"
[ttrpc]
  address = "{p('c.sock')}.ttrpc"
{self.proxy_plugin()}
[{cri}]
  sandbox_image = "{self.pause}"
  # runc would set the sandbox's oom_score_adj to -998, which needs
  # CAP_SYS_RESOURCE: keep containerd's own.
  restrict_oom_score_adj = true
[{cri}.containerd]
  snapshotter = "{self.peer.name}"
  # CRI's labels (cri.image-ref, cri.layer-digest, ...) go to Prepare.
  disable_snapshot_annotations = false
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  Root = "{p('runc')}"
[{cri}.cni]
  bin_dir = "{p('cni/bin')}"
  conf_dir = "{p('cni/conf')}"
[{cri}.registry.mirrors."{self.registry.addr}"]
  endpoint = ["http://{self.registry.addr}"]
"""

    def start(self, peer: Peer) -> None:
        self.stop()
        self.runs += 1
        self.peer = peer
        self.dir = self.base / f"run{self.runs}-{peer.key}"
        for d in ["cni/bin", "cni/conf", "logs", "snap"]:
            self.path(d).mkdir(parents=True)
        log = open(self.path("daemons.log"), "ab")
        if peer.serve is not None:
            self.procs["snapshotter"] = subprocess.Popen(
                [str(a) for a in peer.serve(self.path("snap"), self.path("s.sock"))], stdout=log, stderr=log)
            wait_for(lambda: self.path("s.sock").exists() or self.procs["snapshotter"].poll() is not None,
                     f"the {peer.name} snapshotter's socket", 60)
            if self.procs["snapshotter"].poll() is not None:
                raise RuntimeError(f"the {peer.name} snapshotter exited: {tail(self.path('daemons.log'))}")
        self.path("containerd.toml").write_text(self.containerd_config())
        endpoint = f"unix://{self.path('c.sock')}"
        self.path("crictl.yaml").write_text(
            f"runtime-endpoint: {endpoint}\nimage-endpoint: {endpoint}\ntimeout: 300\n")
        self.procs["containerd"] = subprocess.Popen(
            ["containerd", "--config", str(self.path("containerd.toml"))], stdout=log, stderr=log)

        def cri_up() -> bool:
            if self.procs["containerd"].poll() is not None:
                raise RuntimeError(f"containerd exited: {tail(self.path('daemons.log'))}")
            return subprocess.run([str(a) for a in self.crictl("info", timeout="5s")],
                                  capture_output=True).returncode == 0

        wait_for(cri_up, "containerd's CRI plugin", 60)
        # The sandbox image, untimed (ordinary layers: unpacked by either).
        sh(self.crictl("pull", self.pause))
        self.path("pod.json").write_text(json.dumps({
            "metadata": {"name": "lazy", "namespace": "tilefs-bench", "uid": f"lazy-{self.runs}", "attempt": 0},
            "log_directory": str(self.path("logs")),
            "linux": {
                "cgroup_parent": f"/{CGROUP}",
                # 2 is NODE: the host's network namespace, no CNI.
                "security_context": {"namespace_options": {"network": 2}},
            },
        }))
        self.path("container.json").write_text(json.dumps({
            "metadata": {"name": "main"},
            "image": {"image": peer.image},
            "command": ["/bin/cat", f"/{FIRST_FILE}"],
            "log_path": "main.log",
            "linux": {},
        }))
        os.sync()

    def timed_argv(self) -> list:
        """pull, runp, create, start, then wait for the output in the log
        file; the registry's access log line count at that moment goes to
        `mark`, the time after each step to `phases` (date: ~1 ms each)."""
        crictl = " ".join(f"'{a}'" for a in self.crictl())
        tries = int(OUTPUT_WAIT_S / 0.005)
        script = (
            "set -e\n"
            'date +%s.%N > "$7"\n'
            f'{crictl} pull "$1" >/dev/null\n'
            'date +%s.%N >> "$7"\n'
            f'pod=$({crictl} runp "$2")\n'
            'date +%s.%N >> "$7"\n'
            f'ctr=$({crictl} create "$pod" "$3" "$2")\n'
            f'{crictl} start "$ctr" >/dev/null\n'
            'date +%s.%N >> "$7"\n'
            "i=0\n"
            'until grep -qs PRETTY_NAME "$4"; do\n'
            f'  i=$((i + 1)); [ $i -lt {tries} ] || {{ echo "no output in $4" >&2; exit 1; }}\n'
            "  sleep 0.005\n"
            "done\n"
            'wc -l < "$5" > "$6"\n'
            'date +%s.%N >> "$7"\n'
        )
        return ["sh", "-c", script, "sh", self.peer.image, self.path("pod.json"), self.path("container.json"),
                self.path("logs/main.log"), self.registry.log, self.path("mark"), self.path("phases")]

    def fuse_mounts(self) -> list[str]:
        """The FUSE filesystems mounted below the snapshotter's root."""
        root = str(self.path("snap"))
        out = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split(" - ")
                fields = line.split(" ")
                if len(parts) == 2 and fields[4].startswith(root) and parts[1].startswith("fuse"):
                    out.append(parts[1].split(" ")[0])
        return out

    def stop(self) -> None:
        if self.dir is None:
            return
        if self.procs.get("containerd") and self.procs["containerd"].poll() is None:
            r = subprocess.run([str(a) for a in self.crictl("pods", "-q", timeout="20s")], capture_output=True)
            for pod in r.stdout.decode().split():
                subprocess.run([str(a) for a in self.crictl("stopp", pod, timeout="30s")], capture_output=True)
                subprocess.run([str(a) for a in self.crictl("rmp", "-f", pod, timeout="30s")], capture_output=True)
        shim_sockets = []
        tasks = self.path(f"cstate/io.containerd.runtime.v2.task/{NS}")
        for d in tasks.iterdir() if tasks.is_dir() else []:
            try:
                addr = (d / "address").read_text().strip()
            except OSError:
                continue
            if addr.startswith("unix://"):
                shim_sockets.append(Path(addr[len("unix://"):]))
        p = self.procs.pop("containerd", None)
        if p is not None:
            terminate(p)
        # What CRI could not stop: shims and runc's containers of this run,
        # and whatever is left in the pods' cgroups.
        for pid in lib.processes_naming(str(self.path("c.sock"))):
            kill9(pid)
        runc_root = self.path(f"runc/{NS}")
        for c in runc_root.iterdir() if runc_root.is_dir() else []:
            subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", c.name], capture_output=True)
        remove_cgroup(CGROUP)
        for s in shim_sockets:
            s.unlink(missing_ok=True)
        # Containers' mounts, then the snapshotter's (it unmounts its own
        # on SIGTERM; whatever is left is taken down).
        unmount_below(self.path("cstate"))
        p = self.procs.pop("snapshotter", None)
        if p is not None:
            terminate(p)
        unmount_below(self.dir)
        # FUSE servers of the unmounted images end by themselves.
        deadline = time.time() + 10
        while (left := lib.processes_naming(str(self.dir))) and time.time() < deadline:
            time.sleep(0.1)
        for pid in left:
            kill9(pid)
        unmount_below(self.dir)
        keep = os.environ.get("BENCH_CRI_LOGS")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for f in ["daemons.log", "phases"]:
                if self.path(f).exists():
                    shutil.copy(self.path(f), Path(keep) / f"{self.dir.name}.{f}")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None


def run(b) -> None:
    tools = {t: shutil.which(t) for t in
             ["containerd", "ctr", "runc", "crictl", "docker-registry", "skopeo", "tar"]}
    missing = [t for t, p in tools.items() if not p]
    if os.geteuid() != 0 or missing or not Path("/bin/busybox").exists():
        why = "needs root" if os.geteuid() != 0 else f"missing: {', '.join(missing) or 'busybox-static'}"
        b.skip("cri-lazy/first-output", "crictl pull to a container's first output", why +
               " (scripts/setup installs the tools)")
        return
    work = b.tmpdir(NAME)
    registry = Registry(work)
    rig = Rig(work, registry)
    try:
        _run(b, work, registry, rig)
    finally:
        rig.stop()
        # Whatever else still runs below work (a failure midway).
        for pid in lib.processes_naming(str(work)):
            if registry.proc is None or pid != registry.proc.pid:
                kill9(pid)
        remove_cgroup(CGROUP)
        unmount_below(work)
        registry.stop()
        if os.environ.get("BENCH_CRI_LOGS") and registry.log.exists():
            shutil.copy(registry.log, Path(os.environ["BENCH_CRI_LOGS"]) / "registry-access.log")
        shutil.rmtree(work, ignore_errors=True)


def manifest_of(ref: str) -> tuple[dict, bytes]:
    raw = sh(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"]).stdout
    return json.loads(raw), raw


def artifact_bytes(m: dict, raw: bytes) -> int:
    """What an artifact's manifest, configuration and layers take."""
    return len(raw) + m["config"]["size"] + sum(l["size"] for l in m["layers"])


def tilefs_index_bytes(repo: str, plain: str) -> tuple[int | None, str]:
    """The size of the tilefs index of image `plain`, found as the
    snapshotter finds it here: the OCI fallback tag sha256-HEX of the
    image's manifest digest (Debian's docker-registry has no referrers
    API)."""
    _, raw = manifest_of(plain)
    tag = "sha256-" + hashlib.sha256(raw).hexdigest()
    r = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{repo}:{tag}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"no fallback tag {tag}: {r.stderr.strip()[-200:]}"
    found = [d for d in json.loads(r.stdout).get("manifests", [])
             if d.get("artifactType") == "application/vnd.tilefs.index.v1"]
    if not found:
        return None, f"the fallback tag {tag} lists no tilefs index"
    m, mraw = manifest_of(f"{repo}@{found[-1]['digest']}")
    return artifact_bytes(m, mraw), f"{len(m['layers'])} blobs (the composefs image + a map per layer)"


def soci_convert(soci: Path, layout: Layout, work: Path) -> tuple[Path, int, str]:
    """`soci convert --standalone` of the image "usr": SOCI index manifest
    v2 (a SOCI-enabled image: an image index of the image, its manifest
    annotated with the SOCI index's digest, and the SOCI index). Returns the
    converted layout, the SOCI index's size and what it holds."""
    src, out = work / "soci-in", work / "soci-out"
    src.mkdir()
    shutil.copytree(layout.root / "blobs", src / "blobs", copy_function=os.link)
    shutil.copy(layout.root / "oci-layout", src / "oci-layout")
    index = json.loads((layout.root / "index.json").read_text())
    m = next(d for d in index["manifests"] if d["annotations"]["org.opencontainers.image.ref.name"] == "usr")
    # soci wants the platform in the layout's descriptor, and one image.
    m["platform"] = {"architecture": "amd64", "os": "linux"}
    (src / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [m]}))
    t0 = time.monotonic()
    sh([soci, "convert", "--standalone", "--format", "oci-dir", src, out])
    took = time.monotonic() - t0
    shutil.rmtree(src)
    size, ztocs = None, 0
    for blob in (out / "blobs" / "sha256").iterdir():
        if blob.stat().st_size > 1 << 20:
            continue
        try:
            doc = json.loads(blob.read_bytes())
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("config", {}).get("mediaType") == "application/vnd.amazon.soci.index.v2+json":
            size, ztocs = artifact_bytes(doc, blob.read_bytes()), len(doc["layers"])
    if size is None:
        raise RuntimeError("soci convert made no SOCI index")
    return out, size, f"{ztocs} zTOCs (layers under 10 MiB get none: fetched whole), made in {took:.0f} s"


def _run(b, work: Path, registry: Registry, rig: Rig) -> None:
    tilefs = b.tilefs
    wanted = (os.environ.get("BENCH_CRI_PEERS") or "tilefs tilefs-fuse soci stargz tilefs-esgz overlayfs").split()
    stargz_dir, stargz_build = None, "stargz-snapshotter: not asked for (BENCH_CRI_PEERS)"
    if {"stargz", "tilefs-esgz"} & set(wanted):
        stargz_dir, stargz_build = lib.build_peer(b, "stargz", "STARGZ_BIN_DIR")
    soci_dir, soci_build = None, "SOCI: not asked for (BENCH_CRI_PEERS)"
    if "soci" in wanted:
        soci_dir, soci_build = lib.build_peer(b, "soci", "SOCI_BIN_DIR")
    for d, why in [(stargz_dir, stargz_build), (soci_dir, soci_build)]:
        if d is None:
            b.note(why)
    layout, what = stage_image(b, work, TREES, FIRST_FILE)
    registry.start()
    tls = "--tls-verify=false"
    reg = registry.addr
    repo = f"{reg}/bench/usr"
    plain, pause, esgz, soci_ref = f"{repo}:v1", f"{reg}/bench/pause:v1", f"{repo}:esgz", f"{repo}:soci"
    for name, ref in [("usr", plain), ("pause", pause)]:
        sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{layout.root}:{name}", f"docker://{ref}"])
    images = {}

    # The tilefs index of the ordinary image (made even when only other
    # configurations are measured: its size is reported).
    b.progress("tilefs index ...", final=False)
    t0 = time.monotonic()
    r = subprocess.run([str(a) for a in [tilefs, "index", "-q", tls, "--store", work / "index-store",
                                           f"docker://{plain}"]], capture_output=True, text=True)
    index_s = time.monotonic() - t0
    shutil.rmtree(work / "index-store", ignore_errors=True)
    if r.returncode == 0:
        images["tilefs"] = plain
    else:
        b.note(f"tilefs index failed: {r.stderr.strip()[-300:]}")

    # SOCI's index of the same image.
    soci_index = None
    if soci_dir is not None:
        b.progress("soci convert --standalone ...", final=False)
        try:
            out, soci_index, soci_what = soci_convert(soci_dir / "soci", layout, work)
            sh(["skopeo", "copy", "--all", "-q", "--dest-tls-verify=false", f"oci:{out}", f"docker://{soci_ref}"])
            shutil.rmtree(out)
            images["soci"] = soci_ref
        except (subprocess.CalledProcessError, RuntimeError) as e:
            err = e.stderr.decode(errors="replace") if isinstance(e, subprocess.CalledProcessError) else str(e)
            b.note(f"SOCI's index could not be made: {err.strip()[-300:]}")
            soci_dir = None

    # The eStargz conversion.
    if stargz_dir is not None:
        b.progress("eStargz conversion (stargz-convert) ...", final=False)
        r = subprocess.run([str(stargz_dir / "stargz-convert"), str(layout.root), "usr", str(work / "esgz")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{work / 'esgz'}:usr", f"docker://{esgz}"])
            images["stargz"] = images["tilefs-esgz"] = esgz
        else:
            b.note(f"the eStargz conversion failed: {r.stderr.strip()[-500:]}")
            stargz_dir = None
        shutil.rmtree(work / "esgz", ignore_errors=True)
    images["overlayfs"] = plain
    if "tilefs" in images:
        images["tilefs-fuse"] = plain
    shutil.rmtree(layout.root)
    sizes, layer_counts = {}, {}
    for role, ref in [("plain", plain), ("esgz", esgz if stargz_dir else None)]:
        if ref is None:
            continue
        raw = manifest_of(ref)[0]
        sizes[role] = sum(l["size"] for l in raw["layers"])
        layer_counts[role] = len(raw["layers"])
        if role == "esgz":
            missing = [l["digest"] for l in raw["layers"]
                       if "containerd.io/snapshot/stargz/toc.digest" not in l.get("annotations", {})]
            if missing:
                raise RuntimeError(f"the eStargz image in the registry lost its TOC annotations: {missing}")
    tilefs_index, tilefs_index_what = tilefs_index_bytes(repo, plain) if "tilefs" in images else (None, "")

    def tilefs_serve(root: Path, sock: Path) -> list:
        return [tilefs, "snapshotter", "--root", root / "root", "--store", root / "store", "--socket", sock, tls]

    def tilefs_fuse_serve(root: Path, sock: Path) -> list:
        return tilefs_serve(root, sock) + ["--lazy-fuse"]

    def soci_serve(root: Path, sock: Path) -> list:
        # Defaults but for plain HTTP to the loopback registry and this
        # containerd's socket (SOCI reads image manifests through it).
        (root / "config.toml").write_text(
            f'[content_store]\ncontainerd_address = "{root.parent / "c.sock"}"\n'
            f'[[resolver.host."{reg}".mirrors]]\nhost = "http://{reg}"\ninsecure = true\n')
        return [soci_dir / "soci-snapshotter-grpc", "--address", sock, "--root", root / "root",
                "--config", root / "config.toml", "--log-level", os.environ.get("BENCH_SOCI_LOG", "warn")]

    def stargz_serve(root: Path, sock: Path) -> list:
        return [stargz_dir / "stargz-serve", "-address", sock, "-root", root, "-log-level", "warn"]

    peers = {}
    for key, label, snap, serve, exports in [
        ("tilefs", "tilefs (ordinary image + tilefs index)", "tilefs", tilefs_serve, None),
        ("tilefs-fuse", "tilefs, FUSE lazy (--lazy-fuse; same image)", "tilefs", tilefs_fuse_serve, None),
        ("soci", "SOCI (ordinary image + SOCI index v2)", "soci", soci_serve, lambda root: {"root": root / "root"}),
        ("stargz", "stargz-snapshotter (eStargz)", "stargz", stargz_serve, None),
        ("tilefs-esgz", "tilefs (eStargz)", "tilefs", tilefs_serve, None),
        ("overlayfs", "overlayfs (containerd, full pull)", "overlayfs", None, None),
    ]:
        if key in images and key in wanted:
            peers[key] = Peer(key, label, snap, images[key], serve, exports)

    rig.pause = pause
    bytes_of = {k: [] for k in peers}
    mounts_of = {k: [] for k in peers}
    phases_of = {k: [] for k in peers}
    gets_of = {}
    # The tilefs snapshotter's own time for each layer it made lazily (its log).
    lazily_of = {k: [] for k in peers}
    failures = {}
    current = {}
    seen = {}
    series = {k: lib.Series(p.label, ["sh", str(work / f"timed-{k}.sh")]) for k, p in peers.items()}

    def account() -> None:
        """The run just timed: bytes sent until its first output, its FUSE
        mounts, its output checked; then everything of it is removed."""
        key = current.pop("key", None)
        if key is not None and rig.dir is not None:
            mark = rig.path("mark")
            seen[key] = seen.get(key, 0) + 1
            if mark.exists() and seen[key] == 1:
                pass  # the untimed warm-up
            elif mark.exists():
                end = int(mark.read_text().split()[0])
                gets = registry.blob_gets(current["line"], end)
                bytes_of[key].append(sum(n for _, n in gets))
                gets_of[key] = gets
                mounts_of[key].append(rig.fuse_mounts())
                t = [float(x) for x in rig.path("phases").read_text().split()]
                phases_of[key].append([y - x for x, y in zip(t, t[1:])])
                made = [float(m.group(1)) for l in rig.path("daemons.log").read_text(errors="replace").splitlines()
                        if (m := MADE_LAZILY.search(l))]
                if made:
                    lazily_of[key].append(made)
                out = rig.path("logs/main.log").read_text(errors="replace")
                if "Debian" not in out and key not in failures:
                    failures[key] = f"unexpected output: {out[:200]!r}"
            elif key not in failures:
                failures[key] = f"no output; daemons: {tail(rig.path('daemons.log'), 5)}"
        rig.stop()

    # The timed command is the same file every run; prepare writes into it
    # the script of the run's own directory.
    def prepare(key: str) -> None:
        account()
        try:
            rig.start(peers[key])
        except (RuntimeError, subprocess.CalledProcessError) as e:
            err = e.stderr.decode(errors="replace") if isinstance(e, subprocess.CalledProcessError) else str(e)
            series[key].error = f"could not start: {err.strip()[-300:]}"
            return
        current["key"] = key
        current["line"] = registry.lines()
        argv = rig.timed_argv()
        args = " ".join(f"'{a}'" for a in argv[4:])
        (work / f"timed-{key}.sh").write_text(f"set -- {args}\n{argv[2]}")

    b.progress(f"image: {what}", final=True)
    title = "crictl pull + runp (host network) + create + start to the first output of `cat /usr/lib/os-release`"
    b.interleave(title, series, cold=False, prepare=prepare)
    account()
    for key, why in failures.items():
        series[key].error = series[key].error or why
        series[key].samples.clear()

    notes = [
        "each run: fresh containerd 1.6 (CRI, snapshot annotations on) + fresh snapshotter directories, the "
        "sandbox image pulled untimed; the output is waited for in the container's log file (the file crictl "
        "logs reads), polled every 5 ms; the configurations interleaved, the order rotated every round",
        f"image: {what}; ordinary image {layer_counts['plain']} layers, {sizes['plain'] / 1e6:.0f} MB of blobs"
        + (f"; eStargz {layer_counts['esgz']} layers, {sizes['esgz'] / 1e6:.0f} MB" if "esgz" in sizes else ""),
    ]

    def row(id: str, t: str, ref: str, goal: float | None, why: str) -> None:
        if t not in series or ref not in series:
            return
        r = lib.Row(b.section, id, f"{title}: {peers[t].label} vs {peers[ref].label}", tilefs=series[t],
                    ref=series[ref], ref_tool=peers[ref].label, goal=goal, notes=[why, *notes])
        b.rows.append(r)
        b.progress(lib.summary_line(r))

    row("cri-lazy/index-vs-soci", "tilefs", "soci", GOAL_RATIO, "goal: tilefs <= SOCI, each with its own index "
        "of the same ordinary image; SOCI: " + soci_build)
    row("cri-lazy/index-vs-stargz", "tilefs", "stargz", GOAL_RATIO, "goal: tilefs on the ordinary image <= "
        "stargz-snapshotter on its eStargz conversion; stargz: " + stargz_build)
    row("cri-lazy/esgz", "tilefs-esgz", "stargz", GOAL_RATIO, "goal: tilefs <= stargz-snapshotter, both on the "
        "eStargz image (tilefs from its tables of contents, no index)")
    row("cri-lazy/kernel-vs-fuse", "tilefs", "tilefs-fuse", GOAL_RATIO, "goal: the kernel lazy path (a kernel "
        "overlay over the image's EROFS mount, objects filled on first read through fanotify pre-content events) "
        "no slower than the FUSE lazy path, both on the ordinary image with its tilefs index")
    row("cri-lazy/index-vs-overlayfs", "tilefs", "overlayfs", None, "reference: containerd's overlayfs "
        "snapshotter pulls and unpacks the whole image")
    ok = {k: s for k, s in series.items() if s.ok}
    if ok:
        b.info("cri-lazy/all", "median time to the first output of each configuration",
               "; ".join(f"{peers[k].label} {s.median() * 1000:.0f} ms ±{s.spread() * 100:.0f}%"
                         for k, s in ok.items()),
               {k: {"median_s": s.median(), "runs_s": [x.wall for x in s.samples]} for k, s in ok.items()})
    for key in ["tilefs", "tilefs-esgz"]:
        if key in ok:
            t = ok[key].median()
            b.info(f"cri-lazy/goal-1s/{key}", f"{peers[key].label}: first output under {GOAL_S:g} s",
                   f"{t * 1000:.0f} ms: {'met' if t <= GOAL_S else 'MISSED'}",
                   {"tilefs_s": t, "goal_s": GOAL_S, "goal_met": t <= GOAL_S})
    med = {k: statistics.median(v) for k, v in bytes_of.items() if v}
    if med:
        value = {k: {"median_bytes": m, "runs": bytes_of[k],
                     "fuse_mounts": mounts_of[k][-1] if mounts_of[k] else [],
                     "last_run_blob_gets": gets_of.get(k, [])} for k, m in med.items()}
        value["image_bytes"] = sizes
        goal = ""
        if "tilefs" in med and "soci" in med:
            met = med["tilefs"] <= med["soci"]
            value["goal_met"] = met
            goal = f"; goal tilefs <= SOCI: {'met' if met else 'MISSED'}"
        b.info("cri-lazy/bytes", "blob bytes the registry sent from the pull's start to the first output "
               "(median of the runs; access log; indexes and tables of contents included)",
               "; ".join(f"{peers[k].label} {m / 1e6:.2f} MB" for k, m in med.items()) + goal, value)
    if tilefs_index is not None or soci_index is not None:
        img = sizes["plain"]
        parts, value = [], {"image_bytes": img}
        if tilefs_index is not None:
            parts.append(f"tilefs index {tilefs_index / 1e6:.2f} MB ({tilefs_index / img * 100:.2f}%: "
                         f"{tilefs_index_what}, made in {index_s:.0f} s)")
            value["tilefs_index_bytes"] = tilefs_index
            value["goal_met"] = tilefs_index <= 0.05 * img
        if soci_index is not None:
            parts.append(f"SOCI index {soci_index / 1e6:.2f} MB ({soci_index / img * 100:.2f}%: {soci_what})")
            value["soci_index_bytes"] = soci_index
        goal = f"; goal tilefs <= 5%: {'met' if value.get('goal_met') else 'MISSED'}" if tilefs_index else ""
        b.info("cri-lazy/index-size", f"index sizes (manifest, configuration and blobs) against the compressed "
               f"image ({img / 1e6:.0f} MB of layers)", "; ".join(parts) + goal, value)
    steps = ["crictl pull", "runp", "create + start", "output seen"]
    for key, runs in phases_of.items():
        if runs:
            m = [statistics.median(p[i] for p in runs) for i in range(len(steps))]
            b.info(f"cri-lazy/steps/{key}", f"{peers[key].label}: median time of each step",
                   ", ".join(f"{n} {x * 1000:.0f} ms" for n, x in zip(steps, m)),
                   {"steps": steps, "median_s": m, "runs_s": runs})
    for key in ["tilefs", "tilefs-esgz"]:
        runs = lazily_of.get(key)
        if runs:
            top = statistics.median(r[-1] for r in runs)
            below = statistics.median(sum(r[:-1]) for r in runs)
            b.info(f"cri-lazy/layers/{key}", f"{peers[key].label}: the snapshotter's time making the layers lazily "
                   "(its log; the layers below the top only record what their image will be, made at their "
                   "first mount; the top layer's image is made at the pull)",
                   f"{len(runs[-1])} layers: the top {top * 1000:.0f} ms, the {len(runs[-1]) - 1} below "
                   f"{below * 1000:.0f} ms in all (medians)", {"runs_s": runs})
    for key, m in mounts_of.items():
        if m:
            b.note(f"{peers[key].label}: FUSE mounts below its root at the first output: "
                   f"{len(m[-1])} ({', '.join(sorted(set(m[-1]))) or 'none'})")
