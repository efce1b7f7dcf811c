"""What the sections that run registries and containerd share (registry,
containerd, cri_lazy, podman): commands that must succeed, waiting for a
daemon, Debian's docker-registry on loopback, OCI image layouts written by
hand (and the image cri_lazy and podman pull), stopping processes and
removing the cgroups containerd leaves.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import lib


def sh(argv, **kw) -> subprocess.CompletedProcess:
    """Runs argv (paths allowed), output captured; raises if it fails."""
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True, **kw)


def wait_for(check, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            raise RuntimeError(f"{what}: not after {timeout:g} s")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(p: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM, then SIGKILL if `p` has not ended after `grace` seconds."""
    p.terminate()
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def kill9(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except OSError:
        pass


def unmount_below(d: Path) -> None:
    """Every mount at or below `d`, deepest first (lazily if busy)."""
    with open("/proc/self/mountinfo") as f:
        mounts = [l.split(" ")[4] for l in f]
    prefix = str(d)
    for m in sorted((m for m in mounts if m == prefix or m.startswith(prefix + "/")), key=len, reverse=True):
        if subprocess.run(["umount", m], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", m], capture_output=True)


def remove_cgroup(name: str) -> None:
    """Cgroup /NAME in every hierarchy (v1 and v2) and those below it,
    deepest first, their processes killed: a namespace's or a pod parent's
    cgroup, which containerd makes and never removes."""
    top = Path("/sys/fs/cgroup")
    roots = [top, *(p for p in top.iterdir() if p.is_dir())] if top.is_dir() else []
    dirs = []
    for r in roots:
        if (r / name).is_dir():
            dirs.extend(Path(dp) for dp, _, _ in os.walk(r / name))
    dirs.sort(key=lambda p: len(p.parts), reverse=True)
    for d in dirs:
        try:
            for pid in (d / "cgroup.procs").read_text().split():
                kill9(int(pid))
        except OSError:
            pass
    deadline = time.time() + 5
    for d in dirs:
        while d.exists():
            try:
                d.rmdir()
            except OSError:
                if time.time() > deadline:
                    break
                time.sleep(0.05)


class Registry:
    """Debian's docker-registry (the CNCF distribution server) on a free
    loopback port, plain HTTP, storage and access log under `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.proc = None
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.log = root / "access.log"
        self.config = root / "config.yml"
        self.config.write_text(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.addr}\n")

    def start(self, empty: bool = False) -> None:
        """(Re)starts it; `empty` drops what it stored first."""
        self.stop()
        if empty:
            shutil.rmtree(self.root / "data", ignore_errors=True)
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.config)], stdout=out, stderr=out)

        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                return False

        wait_for(up, "the registry", 20)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def lines(self) -> int:
        """The access log's length: a mark for blob_gets."""
        return len(self.log.read_bytes().splitlines()) if self.log.exists() else 0

    def blob_gets(self, start: int, end: int | None = None) -> list[tuple[str, int]]:
        """(blob digest, bytes sent) of each GET of a blob in lines [start, end)."""
        out = []
        for raw in self.log.read_bytes().splitlines()[start:end]:
            parts = raw.decode(errors="replace").split('"')
            if len(parts) < 3 or not parts[1].startswith("GET ") or "/blobs/" not in parts[1]:
                continue
            fields = parts[2].split()
            if len(fields) >= 2 and fields[1].isdigit():
                out.append((parts[1].split()[1].rsplit("/", 1)[-1], int(fields[1])))
        return out

    def blob_bytes_since(self, line: int) -> int:
        return sum(n for _, n in self.blob_gets(line))


class Layout:
    """An OCI image layout written by hand: gzip'd tar layers, configs, manifests."""

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
        """The layer `tar_argv` writes to its standard output: (descriptor, diff ID)."""
        return self.layer_of(sh(tar_argv).stdout)

    def layer_of(self, raw: bytes) -> tuple[dict, str]:
        """The layer of the tar stream `raw`: (descriptor, diff ID)."""
        diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
        d, n = self.blob(gzip.compress(raw, compresslevel=1))
        return {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": n}, diff_id

    def image(self, name: str, layers: list[tuple[dict, str]], config: dict) -> None:
        """Image `name` of `layers` (bottom first); `config` is its OCI
        configuration's `config` (Cmd, Env, ...)."""
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": config,
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


def generated_layer(layout: Layout, nbytes: int) -> tuple[dict, str]:
    """A layer of files of pseudo-random bytes (incompressible, seeded: the
    same every run), `nbytes` in all, sizes from 16 KiB to 8 MiB
    (log-uniform), under /opt/gen."""
    rng = random.Random(44)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ["opt", "opt/gen"]:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        left, i = nbytes, 0
        while left > 0:
            n = min(left, int(2 ** rng.uniform(14, 23)))
            info = tarfile.TarInfo(f"opt/gen/{i // 100:02d}/{i:05d}.bin")
            if i % 100 == 0:
                dinfo = tarfile.TarInfo(f"opt/gen/{i // 100:02d}")
                dinfo.type, dinfo.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(dinfo)
            info.size, info.mode = n, 0o644
            tar.addfile(info, io.BytesIO(rng.randbytes(n)))
            left -= n
            i += 1
    return layout.layer_of(buf.getvalue())


def stage_image(b, work: Path, default_trees: list[str], first_file: str) -> tuple[Layout, str]:
    """The image the cri_lazy and podman sections pull, "usr" (and the
    pods' sandbox image, "pause"), into an OCI layout under `work`: the
    trees ($BENCH_TREE, else `default_trees`) and `first_file` (what the
    container prints) in three gzip layers, then generated files up to
    BENCH_CRI_IMAGE_MB of compressed layers, then busybox. Returns the
    layout and a description of the image."""
    tree = os.environ.get("BENCH_TREE")
    trees = [Path(tree).resolve().relative_to("/")] if tree else [Path(t) for t in default_trees]
    target = lib.env_int("BENCH_CRI_IMAGE_MB", 1000) * 1_000_000
    entries = []
    for t in trees:
        entries.extend(str(t / p.name) for p in sorted((Path("/") / t).iterdir()))
    groups = [entries[i::3] for i in range(3)]
    # The directories above the trees, and the file the container prints.
    dirs = {str(p) for t in [*trees, Path(first_file)] for p in t.parents if str(p) != "."}
    dirs = sorted(dirs | {str(t) for t in trees})
    layout = Layout(work / "layout")
    layers = []
    for i, g in enumerate(groups):
        b.progress(f"tar + gzip of layer {i + 1}/5 ...", final=False)
        extra = ["--no-recursion", *dirs, "--recursion", first_file] if i == 0 else []
        layers.append(layout.layer_from(["tar", "-C", "/", "-cf", "-", "--numeric-owner", *extra, *g]))

    def busybox_layer(tag: bytes) -> tuple[dict, str]:
        bb = work / "bb"
        (bb / "bin").mkdir(parents=True)
        # Bytes after the ELF image change nothing but the file's digest.
        (bb / "bin" / "busybox").write_bytes(Path("/bin/busybox").read_bytes() + tag)
        os.chmod(bb / "bin" / "busybox", 0o755)
        for app in ["sh", "cat", "sleep", "ls"]:
            os.symlink("busybox", bb / "bin" / app)
        layer = layout.layer_from(["tar", "-C", bb, "-cf", "-", "--numeric-owner", "--mtime=@0", "bin"])
        shutil.rmtree(bb)
        return layer

    bb = busybox_layer(b"")
    gen = max(0, target - sum(l[0]["size"] for l in [*layers, bb]))
    b.progress(f"generated layer of {gen / 1e6:.0f} MB + gzip (layer 4/5) ...", final=False)
    layers.append(generated_layer(layout, gen))
    layout.image("usr", [*layers, bb], {"Cmd": ["/bin/sh"]})
    # The sandbox image's busybox is another file (a store that has it
    # would not fetch the image's).
    layout.image("pause", [busybox_layer(b"\0pause")], {"Entrypoint": ["/bin/sleep"], "Cmd": ["inf"]})
    size = sum(int(sh(["du", "-sxB1", "--apparent-size", Path("/") / t]).stdout.split()[0]) for t in trees)
    what = " ".join(f"/{t}" for t in trees)
    return layout, (f"{what} ({size / 1e9:.2f} GB) + /{first_file} in 3 layers, {gen / 1e6:.0f} MB of generated "
                    f"files (pseudo-random, seeded) in 1, busybox in 1: 5 gzip -1 layers")
