"""Section pull: an OCI image into a store, tilefs vs composefs-rs.

The image: this machine's /usr/share, /usr/include and /usr/bin as three
gzip layers (`tar | gzip -6`, untimed) in an OCI layout. Rows:
  - into an empty store, page cache dropped before every run:
    `tilefs pull` vs `cfsctl oci pull` (a fsverity-sha256-12 repository,
    `--insecure`: this machine has no fs-verity), goal <= 0.5x;
  - the same image again, every object present, cold: goal <= 0.3x.
Both tools' images are checked to have the same digest (`cfsctl oci
compute-id`). Peak RSS is in every row.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "pull"
TITLE = "OCI pull: three gzip layers of /usr into a store, tilefs vs cfsctl oci pull"
ORDER = 35
TREES = ["usr/share", "usr/include", "usr/bin"]
EMPTY_GOAL = 0.5
PRESENT_GOAL = 0.3


def put_blob(layout: Path, path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    d = h.hexdigest()
    dest = layout / "blobs" / "sha256" / d
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, dest)
    return f"sha256:{d}", dest.stat().st_size


def put_bytes(layout: Path, data: bytes) -> tuple[str, int]:
    d = hashlib.sha256(data).hexdigest()
    dest = layout / "blobs" / "sha256" / d
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return f"sha256:{d}", len(data)


def make_layout(b, layout: Path) -> int:
    layers, diff_ids = [], []
    for i, t in enumerate(TREES):
        b.progress(f"pull: tar | gzip /{t} ...", final=False)
        raw = layout / "layer.tar"
        # The first layer lists /usr itself (composefs-rs refuses parents no
        # entry lists).
        first = ["--no-recursion", "usr", "--recursion"] if i == 0 else []
        subprocess.run(["tar", "-C", "/", "--numeric-owner", "-cf", str(raw)] + first + [t], check=True,
                       stderr=subprocess.DEVNULL)
        h = hashlib.sha256()
        with open(raw, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        diff_ids.append(f"sha256:{h.hexdigest()}")
        gz = layout / "layer.tar.gz"
        with open(gz, "wb") as out:
            subprocess.run(["gzip", "-6", "-c", str(raw)], stdout=out, check=True)
        raw.unlink()
        d, n = put_blob(layout, gz)
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": n})
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    cd, cn = put_bytes(layout, config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
                           "layers": layers}).encode()
    md, mn = put_bytes(layout, manifest)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
         "annotations": {"org.opencontainers.image.ref.name": "bench"}}]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return sum(l["size"] for l in layers)


def run(b) -> None:
    cfs = b.tool("cfsctl")
    if shutil.which("skopeo") is None and cfs:
        b.note("skopeo not found: cfsctl oci pull needs it")
        cfs = None
    work = b.tmpdir(NAME)
    layout = work / "layout"
    layout.mkdir()
    blob_bytes = make_layout(b, layout)
    ref = f"oci:{layout}:bench"
    t_store, r_repo = work / "tstore", work / "repo"
    t_argv = [b.tilefs, "pull", "-q", "--store", t_store, ref]
    r_argv = [cfs, "--repo", r_repo, "oci", "pull", ref, "bench"] if cfs else None

    def empty(role: str) -> None:
        if role == "tilefs":
            shutil.rmtree(t_store, ignore_errors=True)
        else:
            shutil.rmtree(r_repo, ignore_errors=True)
            subprocess.run([cfs, "init", "--algorithm", "fsverity-sha256-12", "--insecure", str(r_repo)],
                           check=True, capture_output=True)

    cold = b.can_drop_caches()
    note = "page cache dropped before every run" if cold else "warm cache (dropping caches needs root)"
    built = ("cfsctl: composefs-rs v0.9.0, cargo build --release -p composefs-ctl; "
             "repository fsverity-sha256-12 --insecure (no fs-verity here); it fetches through skopeo")
    b.compare("pull/empty", f"{len(TREES)} gzip layers ({blob_bytes >> 20} MiB) into an empty store ({note})",
              t_argv, r_argv, ref_tool="cfsctl", ref_missing="cfsctl not found (set CFSCTL): tilefs alone",
              cold=cold, prepare=empty, goal=EMPTY_GOAL, nbytes=blob_bytes, notes=[built])
    # The same image again, every object present (the last run's stores).
    b.compare("pull/present", f"the same image again, every object present ({note})",
              t_argv, r_argv, ref_tool="cfsctl", ref_missing="cfsctl not found (set CFSCTL): tilefs alone",
              cold=cold, goal=PRESENT_GOAL, nbytes=blob_bytes,
              notes=["cfsctl finds its layers already imported; tilefs finds the image these layers made (STORE/.layers) and checks its objects are present"])
    t = subprocess.run([str(a) for a in t_argv], capture_output=True, text=True)
    if cfs and t.returncode == 0:
        r = subprocess.run([cfs, "--repo", str(r_repo), "oci", "compute-id", "bench"], capture_output=True, text=True)
        same = r.returncode == 0 and r.stdout.strip() == t.stdout.strip()
        b.info("pull/same-image", "tilefs's image digest equals cfsctl oci compute-id",
               "identical" if same else f"DIFFERENT: tilefs {t.stdout.strip()} cfsctl {r.stdout.strip()}")
    shutil.rmtree(work, ignore_errors=True)
