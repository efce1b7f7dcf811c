"""Section registry: tilefs push, pull and lazy pull through a real registry.

The image: this machine's /usr/share, /usr/include and /usr/bin (about
1.1 GB, 50k objects) built into a store. The registry: Debian's
docker-registry (the CNCF distribution server) on a free 127.0.0.1 port,
plain HTTP, storage in the bench's temporary directory; bytes sent are read
from its access log. Rows:
  - push into an empty registry (restarted empty before every run), and
    the same push again (every blob there: HEAD requests only);
  - pull into an empty store (cold cache);
  - time to first read: `pull --lazy` + `mount` (FUSE) + reading one
    1 MiB file, against a full pull + kernel mount + the same read, in the
    same loop (goal: lazy under 1 s);
  - bytes transferred by each;
  - the artifact's size against a gzip image of the same tree (`tar | gzip
    -6`, the layer an ordinary image would have), and what pushing the
    image with one file of 31 KB more over it uploads (`push --json`:
    artifact format 3 sends the chunks of the image's tree around the new
    file, format 2 sent the whole image).
composefs-rs cannot push, and pulls only images of layers: tilefs alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402
from containers import Registry  # noqa: E402

NAME = "registry"
TITLE = "registry: tilefs push, pull, and lazy pull + first read"
ORDER = 36
TREES = ["usr/share", "usr/include", "usr/bin"]
FIRST_READ_GOAL_S = 1.0


def stage_tree(b, work: Path) -> Path:
    """The three trees under one directory: hardlinked (instant) where /usr
    shares the bench's filesystem, copied otherwise."""
    src = work / "src"
    (src / "usr").mkdir(parents=True)
    for t in TREES:
        b.progress(f"registry: staging /{t} ...", final=False)
        r = subprocess.run(["cp", "-al", f"/{t}", str(src / t)], capture_output=True)
        if r.returncode != 0:
            shutil.rmtree(src / t, ignore_errors=True)
            subprocess.run(["cp", "-a", f"/{t}", str(src / t)], check=True)
    return src


def one_mib_file(src: Path) -> str:
    """A file of about 1 MiB in the tree (relative path)."""
    best = None
    for dirpath, _, files in os.walk(src):
        for f in files:
            p = Path(dirpath) / f
            try:
                st = p.lstat()
            except OSError:
                continue
            if not p.is_symlink() and 900 << 10 <= st.st_size <= 1200 << 10:
                d = abs(st.st_size - (1 << 20))
                if best is None or d < best[0]:
                    best = (d, str(p.relative_to(src)))
    return best[1] if best else "usr/bin/bash"


def run(b) -> None:
    if shutil.which("docker-registry") is None:
        b.skip("all", TITLE, "docker-registry not found (scripts/setup installs it)")
        return
    work = b.tmpdir(NAME)
    reg = Registry(work)
    mnt = work / "mnt"
    mnt.mkdir()
    try:
        _run(b, work, reg, mnt)
    finally:
        if lib.is_mountpoint(mnt):
            subprocess.run([b.tilefs, "umount", str(mnt)], capture_output=True)
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)


def _run(b, work: Path, reg: Registry, mnt: Path) -> None:
    src = stage_tree(b, work)
    store = work / "store"
    b.progress("registry: building the image ...", final=False)
    subprocess.run([b.tilefs, "build", "-q", "--store", str(store), "--tag", "bench", str(src)], check=True)
    objects = sum(1 for d in store.iterdir() if len(d.name) == 2 for _ in d.iterdir())
    nbytes = sum(f.stat().st_size for d in store.iterdir() if len(d.name) == 2 for f in d.iterdir())
    target = one_mib_file(src)
    b.progress("registry: the gzip layer of the tree, and the image with one file more ...", final=False)
    tar = subprocess.Popen(["tar", "cf", "-", "-C", str(src), "."], stdout=subprocess.PIPE)
    gz = subprocess.run(["gzip", "-6"], stdin=tar.stdout, capture_output=True, check=True).stdout
    tar.wait()
    gzip_bytes = len(gz)
    del gz
    added = src / "usr" / "share" / "added-31k"
    added.write_bytes(b"".join(b"%06d a new file of the bench\n" % i for i in range(1000)))
    subprocess.run([b.tilefs, "build", "-q", "--store", str(store), "--tag", "bench-v2", str(src)], check=True)
    shutil.rmtree(src)
    remote = f"docker://{reg.addr}/bench/usr:v1"
    tls = "--tls-verify=false"
    reg.start(empty=True)
    cold = b.can_drop_caches()
    note = "page cache dropped before every run" if cold else "warm cache (dropping caches needs root)"
    facts = f"{objects} objects, {nbytes / 1e9:.2f} GB"

    push = [b.tilefs, "push", "-q", tls, "--store", store, "bench", remote]
    b.compare("push/empty", f"push into an empty registry ({facts}; registry restarted empty before each run)",
              push, None, ref_tool="-", ref_missing="no peer can push a composefs image: tilefs alone",
              prepare=lambda _: reg.start(empty=True), nbytes=nbytes, runs=max(1, b.cold_runs))
    line = reg.lines()
    b.compare("push/again", "the same push again (every blob in the repository: HEAD requests only)",
              push, None, ref_tool="-", ref_missing="tilefs alone", nbytes=nbytes)
    uploads = sum(1 for raw in reg.log.read_bytes().splitlines()[line:] if b'PUT /v2/' in raw and b'/blobs/' in raw)
    b.info("push/again-uploads", "blob uploads by the pushes again", str(uploads))
    blobs = sum(f.stat().st_size for f in (reg.root / "data").rglob("data") if f.is_file())
    b.info("push/size", "the artifact against a gzip image of the same tree (goal: at most 1.1x)",
           f"{blobs / 1e6:.1f} MB against {gzip_bytes / 1e6:.1f} MB ({blobs / gzip_bytes:.2f}x)",
           {"artifact": blobs, "gzip": gzip_bytes, "ratio": blobs / gzip_bytes})
    out = subprocess.run([str(a) for a in [b.tilefs, "push", "-q", "--json", tls, "--store", store, "bench-v2", remote]],
                         capture_output=True, check=True).stdout
    sent = json.loads(out)
    b.info("push/new-version", "the image with one file of 31 KB more, pushed over it: bytes uploaded (goal: < 1 MB)",
           f"{sent['bytes_uploaded'] / 1e6:.3f} MB in {sent['blobs_uploaded']} blobs ({sent['packs_kept']} packs kept, "
           f"artifact format {sent.get('format', 2)})",
           {"bytes_uploaded": sent["bytes_uploaded"], "blobs_uploaded": sent["blobs_uploaded"],
            "packs_kept": sent["packs_kept"], "format": sent.get("format", 2)})
    # Back to the first version for the pulls below.
    reg.start(empty=True)
    subprocess.run([str(a) for a in push], check=True)

    pstore = work / "pstore"
    pull = [b.tilefs, "pull", "-q", tls, "--store", pstore, remote]
    b.compare("pull/empty", f"pull into an empty store ({note})", pull, None, ref_tool="-",
              ref_missing="composefs-rs pulls only images of layers: tilefs alone",
              cold=cold, prepare=lambda _: shutil.rmtree(pstore, ignore_errors=True), nbytes=nbytes)
    line = reg.lines()
    shutil.rmtree(pstore, ignore_errors=True)
    subprocess.run([str(a) for a in pull], check=True)
    full_bytes = reg.blob_bytes_since(line)

    # Time to first read: lazy (FUSE) against full (kernel), in one loop;
    # the unmount of the run before is untimed.
    lstore = work / "lstore"
    tag = f"{reg.addr}_bench_usr:v1"

    def first_read(lazy: bool) -> list:
        return [
            "sh", "-c",
            f'"$0" pull -q {tls} {"--lazy" if lazy else ""} --store "$1" "$2" && '
            f'"$0" mount {"--fuse" if lazy else "--kernel"} --store "$1" "$3" "$4" 2>/dev/null && '
            f'cat "$4/$5" >/dev/null',
            b.tilefs, lstore, remote, tag, mnt, target,
        ]

    def fresh(_role: str = "") -> None:
        if lib.is_mountpoint(mnt):
            subprocess.run([b.tilefs, "umount", str(mnt)], check=True)
        shutil.rmtree(lstore, ignore_errors=True)

    b.compare("first-read", f"time to first read: pull --lazy + FUSE mount + read one {target.split('/')[-1]} "
              f"(~1 MiB) vs full pull + kernel mount + the same read ({note})",
              first_read(True), first_read(False), ref_tool="full pull + kernel mount", cold=cold,
              prepare=fresh,
              notes=[f"goal: the lazy path under {FIRST_READ_GOAL_S:.0f} s; the ratio is lazy / full"])
    fresh()
    line = reg.lines()
    subprocess.run([str(a) for a in first_read(True)], check=True)
    lazy_bytes = reg.blob_bytes_since(line)
    fresh()
    b.info("bytes", "blob bytes sent by the registry",
           f"full pull {full_bytes / 1e6:.1f} MB; lazy pull + one ~1 MiB read {lazy_bytes / 1e6:.2f} MB "
           f"({lazy_bytes / max(full_bytes, 1) * 100:.2f}% of the full pull)",
           {"full_pull": full_bytes, "lazy_first_read": lazy_bytes})
