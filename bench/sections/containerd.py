"""Section containerd: tilefs snapshotter against containerd's own overlayfs
snapshotter, under the same containerd (Debian's), images in Debian's
docker-registry on loopback.

The image: this machine's BENCH_TREE (default /usr/share) in three layers
(its top-level entries split in three, gzip -1), plus busybox to run. A
second image shares 90% of its files: the same trees in layers of other
digests (other tar mtimes, so containerd unpacks them again) plus a layer of
new files, a tenth of the first image's bytes. Rows:
  - pull + unpack (ctr image pull): before every run the image is removed
    with containerd's gc (--sync) and, for tilefs, `tilefs gc` empties the
    store, so both fetch and unpack everything;
  - `ctr run` to a container's first output, and `ls -lR` of the tree in a
    container (warm);
  - disk used by both images: containerd's overlayfs snapshots against the
    tilefs store and the snapshotter's state.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "containerd"
TITLE = "containerd: tilefs snapshotter vs containerd's overlayfs snapshotter"
ORDER = 38
PULL_GOAL = 1.0
RUN_GOAL = 1.1
LS_GOAL = 1.05
DISK_GOAL = 0.6


def sh(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True, **kw)


def du(*paths: Path) -> int:
    total = 0
    for p in paths:
        if p.exists():
            out = sh(["du", "-sxB1", p]).stdout.split()[0]
            total += int(out)
    return total


class Layout:
    """An OCI image layout written by hand: gzip'd tar layers, a config, a manifest."""

    def __init__(self, root: Path):
        self.root = root
        (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        self.manifests = []

    def blob(self, data: bytes) -> tuple[str, int]:
        d = hashlib.sha256(data).hexdigest()
        (self.root / "blobs" / "sha256" / d).write_bytes(data)
        return "sha256:" + d, len(data)

    def layer_from(self, tar_argv: list) -> tuple[dict, str]:
        raw = sh(tar_argv).stdout
        diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
        d, n = self.blob(gzip.compress(raw, compresslevel=1))
        return {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": n}, diff_id

    def image(self, name: str, layers: list[tuple[dict, str]]) -> None:
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": [l[1] for l in layers]},
        }
        cd, cn = self.blob(json.dumps(config).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
            "layers": [l[0] for l in layers],
        }
        md, mn = self.blob(json.dumps(manifest).encode())
        self.manifests.append({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": md,
            "size": mn,
            "annotations": {"org.opencontainers.image.ref.name": name},
        })
        (self.root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": self.manifests}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.1)


def run(b) -> None:
    tools = {t: shutil.which(t) for t in ["containerd", "ctr", "runc", "docker-registry", "skopeo", "tar"]}
    missing = [t for t, p in tools.items() if not p]
    if os.geteuid() != 0 or missing or not Path("/bin/busybox").exists():
        why = "needs root" if os.geteuid() != 0 else f"missing: {', '.join(missing) or 'busybox-static'}"
        b.skip("containerd/pull", "containerd pull + unpack", why + " (scripts/setup installs the tools)")
        return
    tree = Path(os.environ.get("BENCH_TREE") or "/usr/share")
    work = b.tmpdir(NAME)
    procs = []
    try:
        _run(b, work, tree, procs)
    finally:
        ctr_sock = work / "c.sock"
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with open("/proc/self/mountinfo") as f:
            mounts = [l.split(" ")[4] for l in f]
        for m in sorted((m for m in mounts if m.startswith(str(work))), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        del ctr_sock


def _run(b, work: Path, tree: Path, procs: list) -> None:
    tilefs = b.tilefs
    # The images.
    b.progress(f"making the images from {tree}")
    top = sorted(p.name for p in tree.iterdir())
    groups = [top[i::3] for i in range(3)]
    rel = tree.relative_to("/")
    layout = Layout(work / "layout")
    bb = work / "bb"
    (bb / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", bb / "bin" / "busybox")
    for app in ["sh", "ls", "echo", "true"]:
        if not (bb / "bin" / app).exists():
            os.symlink("busybox", bb / "bin" / app)
    a_layers, b_layers = [], []
    for i, g in enumerate(groups):
        members = [str(rel / n) for n in g]
        a_layers.append(layout.layer_from(["tar", "-C", "/", "-cf", "-", "--numeric-owner", *members]))
        b_layers.append(layout.layer_from(["tar", "-C", "/", "-cf", "-", "--numeric-owner", "--mtime=@1", *members]))
    busybox = layout.layer_from(["tar", "-C", bb, "-cf", "-", "--numeric-owner", "bin"])
    total = sum(int(x) for x in sh(["du", "-sxB1", "--apparent-size", tree]).stdout.split()[:1])
    extra = work / "extra"
    (extra / "new").mkdir(parents=True, exist_ok=True)
    left, n = total // 10, 0
    while left > 0:
        size = min(left, 1 << 20)
        (extra / "new" / f"f{n}").write_bytes(os.urandom(size))
        left -= size
        n += 1
    layout.image("a", [*a_layers, busybox])
    layout.image("b", [*b_layers, layout.layer_from(["tar", "-C", extra, "-cf", "-", "new"]), busybox])
    shutil.rmtree(extra)

    # The registry, the snapshotter, containerd.
    reg_root = work / "registry"
    reg_root.mkdir(exist_ok=True)
    port = free_port()
    addr = f"127.0.0.1:{port}"
    (reg_root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {reg_root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {addr}\n")
    log = open(work / "daemons.log", "ab")
    procs.append(subprocess.Popen(["docker-registry", "serve", str(reg_root / "config.yml")], stdout=log, stderr=log))

    def registry_up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(registry_up, "the registry")
    refs = {}
    for name in ["a", "b"]:
        refs[name] = f"{addr}/bench/{name}:v1"
        sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{layout.root}:{name}", f"docker://{refs[name]}"])
    shutil.rmtree(layout.root)

    store, snaproot, snap_sock = work / "store", work / "snaproot", work / "s.sock"
    procs.append(subprocess.Popen([tilefs, "snapshotter", "--root", snaproot, "--store", store, "--socket", snap_sock],
                                  stdout=log, stderr=log))
    wait_for(snap_sock.exists, "the snapshotter")
    sock = work / "c.sock"
    croot = work / "croot"
    config = work / "containerd.toml"
    config.write_text(
        f'version = 2\nroot = "{croot}"\nstate = "{work / "cstate"}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n'
        f'[proxy_plugins]\n  [proxy_plugins.tilefs]\n    type = "snapshot"\n    address = "{snap_sock}"\n')
    procs.append(subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=log))
    ctr = ["ctr", "--address", sock, "--namespace", "bench"]
    wait_for(lambda: subprocess.run([str(a) for a in ctr + ["version"]], capture_output=True).returncode == 0,
             "containerd")
    snap = {"tilefs": "tilefs", "reference": "overlayfs"}

    def remove_images(role: str | None = None) -> None:
        for name in ["a", "b"]:
            subprocess.run([str(a) for a in ctr + ["images", "rm", "--sync", refs[name]]], capture_output=True)
        if role in (None, "tilefs"):
            subprocess.run([tilefs, "gc", "--store", str(store)], capture_output=True)
        # The removals' writeback is not left to the timed run.
        os.sync()

    def pull_argv(role: str, name: str = "a") -> list:
        return ctr + ["images", "pull", "--plain-http", "--snapshotter", snap[role], refs[name]]

    b.compare(
        "containerd/pull",
        f"ctr image pull + unpack of {tree} in 3 layers (+busybox), from a registry on loopback",
        pull_argv("tilefs"),
        pull_argv("reference"),
        ref_tool="containerd overlayfs",
        prepare=remove_images,
        goal=PULL_GOAL,
        nbytes=total,
        notes=["containerd's content store and both snapshotters emptied before every run (gc --sync; tilefs gc)"],
    )

    # Both images, with each snapshotter: disk used.
    remove_images()
    for role in ["tilefs", "reference"]:
        for name in ["a", "b"]:
            sh(pull_argv(role, name))
    # The snapshotter stores committed layers after Commit returns: the
    # disk is measured once it has (one image tag per committed snapshot).
    def settled() -> bool:
        out = sh(ctr + ["snapshots", "--snapshotter", "tilefs", "ls"]).stdout.decode()
        committed = sum(1 for l in out.splitlines()[1:] if l.split()[-1:] == ["Committed"])
        images = store / "images"
        tags = sum(1 for p in images.iterdir() if p.name.startswith("snapshotter-")) if images.exists() else 0
        return tags == committed

    wait_for(settled, "the snapshotter's layers", timeout=300)
    ovl = croot / "io.containerd.snapshotter.v1.overlayfs"
    t_disk, r_disk = du(store, snaproot), du(ovl)
    ratio = t_disk / r_disk if r_disk else float("nan")
    b.info(
        "containerd/disk",
        "disk used by two images sharing 90% of their files (tilefs store + snapshotter state / overlayfs snapshots)",
        f"{t_disk / 1e6:.0f} MB / {r_disk / 1e6:.0f} MB = {ratio:.2f} (goal <= {DISK_GOAL})",
        {"tilefs_bytes": t_disk, "overlayfs_bytes": r_disk, "ratio": ratio, "goal": DISK_GOAL,
         "goal_met": ratio <= DISK_GOAL},
    )

    def run_argv(role: str, cmd: list) -> list:
        return ctr + ["run", "--rm", "--snapshotter", snap[role], refs["a"], f"bench-{role}", *cmd]

    b.compare(
        "containerd/run",
        "ctr run to a container's first output (busybox echo)",
        run_argv("tilefs", ["/bin/echo", "hi"]),
        run_argv("reference", ["/bin/echo", "hi"]),
        ref_tool="containerd overlayfs",
        goal=RUN_GOAL,
        same_stdout=lambda x, y: x == y,
    )
    b.compare(
        "containerd/ls",
        f"ls -lR /{rel} in a container (warm)",
        run_argv("tilefs", ["/bin/sh", "-c", f"ls -lR /{rel} > /dev/null"]),
        run_argv("reference", ["/bin/sh", "-c", f"ls -lR /{rel} > /dev/null"]),
        ref_tool="containerd overlayfs",
        goal=LS_GOAL,
    )
    remove_images()
