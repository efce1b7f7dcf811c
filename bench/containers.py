"""What the sections that run registries and containerd share (registry,
containerd, cri_lazy): commands that must succeed, waiting for a daemon,
Debian's docker-registry on loopback, OCI image layouts written by hand,
stopping processes and removing the cgroups containerd leaves.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


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
