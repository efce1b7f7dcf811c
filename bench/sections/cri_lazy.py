"""Section cri_lazy: lazy starts through containerd's CRI plugin, the tilefs
snapshotter on a runnable tilefs image against stargz-snapshotter on an
eStargz conversion of the same image.

The image: this machine's /usr/share, /usr/include and /usr/bin (about
1.2 GB; BENCH_TREE, when set, instead), with /usr/lib/os-release, in three
gzip'd layers (the trees' top-level entries split in three) plus busybox,
pushed as an ordinary OCI image to Debian's docker-registry on a free
127.0.0.1 port (plain HTTP, access log on). From it, untimed:
  - the runnable tilefs image: `tilefs pull` into a scratch store, then
    `tilefs push --runnable-from docker://ORIGINAL`;
  - the eStargz image: every layer through stargz-snapshotter's estargz
    library (bench/stargz: `stargz-convert`, estargz.Build's defaults, the
    TOC digest and uncompressed size annotations), copied in by skopeo.
Each run starts from nothing: a fresh containerd (Debian's, CRI plugin on,
the peer's snapshotter as its proxy plugin and CRI's snapshotter, snapshot
annotations on) with a fresh snapshotter, both on new directories, and the
pods' sandbox image pulled (untimed). Timed: `crictl pull` of the image,
`crictl runp` of a host-network pod, `crictl create` + `start` of a
container running `cat /usr/lib/os-release`, until its output is in the
container's log file (the file `crictl logs` reads). After each run the pod
is stopped and removed, containerd and the snapshotter are stopped, their
mounts taken down and their directories removed. Rows: the time (goal:
tilefs <= 1 s, and ratio tilefs / stargz <= 1), and the blob bytes the
registry sent from the pull's start to the first output (access log).
stargz-snapshotter: bench/stargz/build.sh builds it (see
bench/stargz/README.md); without it tilefs is measured alone.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402
from containers import Layout, Registry, kill9, remove_cgroup, sh, terminate, unmount_below, wait_for  # noqa: E402

NAME = "cri_lazy"
TITLE = "lazy starts through CRI: tilefs snapshotter vs stargz-snapshotter"
ORDER = 39
TREES = ["usr/share", "usr/include", "usr/bin"]
FIRST_FILE = "usr/lib/os-release"
GOAL_RATIO = 1.0
GOAL_S = 1.0
NS = "k8s.io"
CGROUP = "tilefs-bench-cri-lazy"
# How long the timed script waits for the container's output.
OUTPUT_WAIT_S = 120


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class Peer:
    """One side of the comparison: its snapshotter's command and image."""

    def __init__(self, role: str, name: str, image: str, serve):
        self.role = role  # "tilefs" or "reference"
        self.name = name  # the proxy plugin's name, CRI's snapshotter
        self.image = image
        self.serve = serve  # (root, socket) -> argv


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
[proxy_plugins]
  [proxy_plugins.{self.peer.name}]
    type = "snapshot"
    address = "{p('s.sock')}"
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
        self.dir = self.base / f"run{self.runs}-{peer.name}"
        for d in ["cni/bin", "cni/conf", "logs", "snap"]:
            self.path(d).mkdir(parents=True)
        log = open(self.path("daemons.log"), "ab")
        self.procs["snapshotter"] = subprocess.Popen(
            [str(a) for a in peer.serve(self.path("snap"), self.path("s.sock"))], stdout=log, stderr=log)
        wait_for(lambda: self.path("s.sock").exists() or self.procs["snapshotter"].poll() is not None,
                 f"the {peer.name} snapshotter's socket")
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
        for pid in processes_naming(str(self.path("c.sock"))):
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
        while (left := processes_naming(str(self.dir))) and time.time() < deadline:
            time.sleep(0.1)
        for pid in left:
            kill9(pid)
        unmount_below(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None


def processes_naming(needle: str) -> list[int]:
    me = os.getpid()
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit() or int(e) == me:
            continue
        try:
            argv = Path(f"/proc/{e}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(needle.encode() in a for a in argv):
            out.append(int(e))
    return out


def build_stargz(b) -> tuple[Path | None, str]:
    """bench/stargz/build.sh: the peer's directory and how it was built, or
    None and why not."""
    script = lib.BENCH_DIR / "stargz" / "build.sh"
    b.progress("building the stargz-snapshotter peer (bench/stargz/build.sh) if absent ...", final=False)
    r = subprocess.run([str(script)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        lines = [l for l in (r.stderr + r.stdout).splitlines() if l.strip()]
        return None, "stargz-snapshotter could not be built (bench/stargz/build.sh): " + " / ".join(lines[-3:])
    d = Path(r.stdout.strip().splitlines()[-1])
    return d, (d / "BUILD").read_text().strip()


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
        for pid in processes_naming(str(work)):
            if registry.proc is None or pid != registry.proc.pid:
                kill9(pid)
        remove_cgroup(CGROUP)
        unmount_below(work)
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)


def stage(b, work: Path) -> tuple[Layout, str]:
    """The ordinary image (and the pods' sandbox image) into an OCI layout."""
    tree = os.environ.get("BENCH_TREE")
    trees = [Path(tree).resolve().relative_to("/")] if tree else [Path(t) for t in TREES]
    entries = []
    for t in trees:
        entries.extend(str(t / p.name) for p in sorted((Path("/") / t).iterdir()))
    groups = [entries[i::3] for i in range(3)]
    # The directories above the trees, and the file the container prints.
    dirs = {str(p) for t in [*trees, Path(FIRST_FILE)] for p in t.parents if str(p) != "."}
    dirs = sorted(dirs | {str(t) for t in trees})
    layout = Layout(work / "layout")
    layers = []
    for i, g in enumerate(groups):
        b.progress(f"tar + gzip of layer {i + 1}/3 ...", final=False)
        extra = ["--no-recursion", *dirs, "--recursion", FIRST_FILE] if i == 0 else []
        layers.append(layout.layer_from(["tar", "-C", "/", "-cf", "-", "--numeric-owner", *extra, *g]))

    def busybox_layer(tag: bytes) -> tuple[dict, str]:
        bb = work / "bb"
        (bb / "bin").mkdir(parents=True)
        # Bytes after the ELF image change nothing but the file's digest.
        (bb / "bin" / "busybox").write_bytes(Path("/bin/busybox").read_bytes() + tag)
        os.chmod(bb / "bin" / "busybox", 0o755)
        for app in ["sh", "cat", "sleep", "ls"]:
            os.symlink("busybox", bb / "bin" / app)
        layer = layout.layer_from(["tar", "-C", bb, "-cf", "-", "--numeric-owner", "bin"])
        shutil.rmtree(bb)
        return layer

    layout.image("usr", [*layers, busybox_layer(b"")], {"Cmd": ["/bin/sh"]})
    # The sandbox image's busybox is another file (a store that has it
    # would not fetch the image's).
    layout.image("pause", [busybox_layer(b"\0pause")], {"Entrypoint": ["/bin/sleep"], "Cmd": ["inf"]})
    size = sum(int(sh(["du", "-sxB1", "--apparent-size", Path("/") / t]).stdout.split()[0]) for t in trees)
    what = " ".join(f"/{t}" for t in trees)
    return layout, f"{what} ({size / 1e9:.2f} GB) + /{FIRST_FILE} + busybox, 4 gzip layers"


def _run(b, work: Path, registry: Registry, rig: Rig) -> None:
    tilefs = b.tilefs
    stargz_dir, stargz_build = build_stargz(b)
    if stargz_dir is None:
        b.note(stargz_build)
    layout, what = stage(b, work)
    registry.start()
    tls = "--tls-verify=false"
    reg = registry.addr
    plain, pause = f"{reg}/bench/usr:v1", f"{reg}/bench/pause:v1"
    for name, ref in [("usr", plain), ("pause", pause)]:
        sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{layout.root}:{name}", f"docker://{ref}"])

    # (a) the runnable tilefs image.
    b.progress("tilefs pull + push --runnable-from ...", final=False)
    scratch = work / "scratch-store"
    lazy = f"{reg}/bench/usr:lazy"
    sh([tilefs, "pull", "-q", tls, "--store", scratch, "--tag", "usr", f"docker://{plain}"])
    sh([tilefs, "push", "-q", tls, "--store", scratch, "--runnable-from", f"docker://{plain}", "usr",
        f"docker://{lazy}"])
    shutil.rmtree(scratch)
    images = {"tilefs": lazy}

    # (b) the eStargz conversion.
    if stargz_dir is not None:
        b.progress("eStargz conversion (stargz-convert) ...", final=False)
        esgz = f"{reg}/bench/usr:esgz"
        r = subprocess.run([str(stargz_dir / "stargz-convert"), str(layout.root), "usr", str(work / "esgz")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{work / 'esgz'}:usr", f"docker://{esgz}"])
            images["reference"] = esgz
        else:
            b.note(f"the eStargz conversion failed: {r.stderr.strip()[-500:]}")
            stargz_dir = None
        shutil.rmtree(work / "esgz", ignore_errors=True)
    shutil.rmtree(layout.root)
    sizes, layer_counts = {}, {}
    for role, ref in [("plain", plain), *images.items()]:
        raw = json.loads(sh(["skopeo", "inspect", "--raw", tls, f"docker://{ref}"]).stdout)
        sizes[role] = sum(l["size"] for l in raw["layers"])
        layer_counts[role] = len(raw["layers"])
        if role == "reference":
            missing = [l["digest"] for l in raw["layers"]
                       if "containerd.io/snapshot/stargz/toc.digest" not in l.get("annotations", {})]
            if missing:
                raise RuntimeError(f"the eStargz image in the registry lost its TOC annotations: {missing}")

    peers = {
        "tilefs": Peer("tilefs", "tilefs", lazy, lambda root, sock: [
            tilefs, "snapshotter", "--root", root / "root", "--store", root / "store", "--socket", sock, tls]),
    }
    if stargz_dir is not None:
        peers["reference"] = Peer("reference", "stargz", images["reference"], lambda root, sock: [
            stargz_dir / "stargz-serve", "-address", sock, "-root", root, "-log-level", "warn"])

    rig.pause = pause
    bytes_of = {"tilefs": [], "reference": []}
    mounts_of = {"tilefs": [], "reference": []}
    phases_of = {"tilefs": [], "reference": []}
    seen = {}
    gets_of = {}
    # The tilefs snapshotter's own time for each layer it made lazily (its log).
    lazily_of = {"tilefs": [], "reference": []}
    failures = {}
    current = {}

    def account() -> None:
        """The run just timed: bytes sent until its first output, its FUSE
        mounts, its output checked; then everything of it is removed."""
        role = current.pop("role", None)
        if role is not None and rig.dir is not None:
            mark = rig.path("mark")
            seen[role] = seen.get(role, 0) + 1
            if mark.exists() and seen[role] == 1:
                pass  # the untimed warm-up
            elif mark.exists():
                end = int(mark.read_text().split()[0])
                gets = registry.blob_gets(current["line"], end)
                bytes_of[role].append(sum(n for _, n in gets))
                gets_of[role] = gets
                mounts_of[role].append(rig.fuse_mounts())
                t = [float(x) for x in rig.path("phases").read_text().split()]
                phases_of[role].append([y - x for x, y in zip(t, t[1:])])
                made = [float(l.rsplit("(", 1)[1].split()[0]) for l in
                        rig.path("daemons.log").read_text(errors="replace").splitlines()
                        if "made lazily (" in l]
                if made:
                    lazily_of[role].append(made)
                out = rig.path("logs/main.log").read_text(errors="replace")
                if "Debian" not in out and role not in failures:
                    failures[role] = f"unexpected output: {out[:200]!r}"
            elif role not in failures:
                failures[role] = f"no output; daemons: {tail(rig.path('daemons.log'), 5)}"
        rig.stop()

    def prepare(role: str) -> None:
        account()
        rig.start(peers[role])
        current["role"] = role
        current["line"] = registry.lines()

    # The timed command is the same file every run; prepare writes into it
    # the script of the run's own directory.
    def argv_for(role: str) -> list:
        return ["sh", work / f"timed-{role}.sh"]

    def prepare_and_write(role: str) -> None:
        prepare(role)
        argv = rig.timed_argv()
        args = " ".join(f"'{a}'" for a in argv[4:])
        (work / f"timed-{role}.sh").write_text(f"set -- {args}\n{argv[2]}")

    ref_argv = argv_for("reference") if "reference" in peers else None
    b.progress(f"images: {what}", final=True)
    stargz_note = (f"stargz-snapshotter: {stargz_build}; bench/stargz/serve serves the library's "
                   "service.NewStargzSnapshotterService (containerd-stargz-grpc's call, default configuration: "
                   "memory metadata store, background fetch on, no prefetch for an unoptimized image)"
                   if stargz_dir is not None else stargz_build)
    row = b.compare(
        "cri-lazy/first-output",
        "crictl pull + runp (host network) + create + start to the first output of `cat /usr/lib/os-release`, "
        f"image of {what}",
        argv_for("tilefs"),
        ref_argv,
        ref_tool="stargz-snapshotter",
        ref_missing=None if ref_argv else f"{stargz_build}: tilefs alone",
        prepare=prepare_and_write,
        goal=GOAL_RATIO,
        notes=[
            f"goal: tilefs <= {GOAL_S:g} s and <= {GOAL_RATIO:g} x stargz-snapshotter",
            "each run: fresh containerd 1.6 (CRI, snapshot annotations on) + fresh snapshotter directories, "
            "the sandbox image pulled untimed; the output is waited for in the container's log file "
            "(the file crictl logs reads), polled every 5 ms",
            f"tilefs: `tilefs push --runnable-from` of the ordinary image ({layer_counts['tilefs']} layers, "
            f"{sizes['tilefs'] / 1e6:.0f} MB of blobs; the ordinary image {layer_counts['plain']} layers, "
            f"{sizes['plain'] / 1e6:.0f} MB); snapshotter --tls-verify=false",
            *([f"stargz: eStargz conversion by estargz.Build (gzip -9, chunk 4 MiB default, no prioritized "
               f"files), {layer_counts['reference']} layers, {sizes['reference'] / 1e6:.0f} MB of blobs"]
              if "reference" in sizes else []),
            stargz_note,
        ],
    )
    account()
    for role, why in failures.items():
        row.notes.append(f"{role}: {why}")
    t = row.tilefs.median() if row.tilefs.ok else None
    if t is not None:
        b.info("cri-lazy/goal-1s", f"tilefs's first output under {GOAL_S:g} s",
               f"{t * 1000:.0f} ms: {'met' if t <= GOAL_S else 'MISSED'}",
               {"tilefs_s": t, "goal_s": GOAL_S, "goal_met": t <= GOAL_S})
    parts, value = [], {}
    for role, label in [("tilefs", "tilefs"), ("reference", "stargz")]:
        if bytes_of[role]:
            m = statistics.median(bytes_of[role])
            parts.append(f"{label} {m / 1e6:.2f} MB")
            value[label] = {"median_bytes": m, "runs": bytes_of[role],
                            "fuse_mounts": mounts_of[role][-1] if mounts_of[role] else [],
                            "last_run_blob_gets": gets_of.get(role, [])}
    if parts:
        value["image_bytes"] = sizes
        value["image_layers"] = layer_counts
        b.info("cri-lazy/bytes", "blob bytes the registry sent from the pull's start to the first output "
               "(median of the runs; access log)",
               "; ".join(parts) + f" (ordinary image {sizes['plain'] / 1e6:.0f} MB)", value)
    steps = ["crictl pull", "runp", "create + start", "output seen"]
    for role, label in [("tilefs", "tilefs"), ("reference", "stargz")]:
        if phases_of[role]:
            med = [statistics.median(p[i] for p in phases_of[role]) for i in range(len(steps))]
            b.info(f"cri-lazy/steps-{label}", f"{label}: median time of each step of the timed runs",
                   ", ".join(f"{n} {m * 1000:.0f} ms" for n, m in zip(steps, med)),
                   {"steps": steps, "median_s": med, "runs_s": phases_of[role]})
    if lazily_of["tilefs"]:
        runs = lazily_of["tilefs"]
        first = statistics.median(r[0] for r in runs)
        rest = statistics.median(sum(r[1:]) for r in runs)
        b.info("cri-lazy/tilefs-layers", "tilefs snapshotter: its time making the layers lazily (its log; the "
               "first pulls the image and index, the others reuse its check and image)",
               f"{len(runs[-1])} layers: the first {first * 1000:.0f} ms, the other {len(runs[-1]) - 1} "
               f"{rest * 1000:.0f} ms in all (medians)",
               {"runs_s": runs})
    for role, label in [("tilefs", "tilefs"), ("reference", "stargz")]:
        if mounts_of[role]:
            b.note(f"{label}: FUSE mounts below its root at the first output: "
                   f"{len(mounts_of[role][-1])} ({', '.join(sorted(set(mounts_of[role][-1])))})")
