"""Section lazy_kernel: a lazily pulled image mounted by the kernel (issue 45).

The image: this machine's /usr/include (about 130 MB, 9k files) and one
file of 5 MiB of random bytes, built, pushed to Debian's docker-registry on
a free 127.0.0.1 port (plain HTTP), and pulled with `--lazy` into stores
in the bench's temporary directory (a filesystem that takes fanotify
pre-content marks, or the section says why not and stops). Rows:
  - first read of the 5 MiB file: `tilefs mount` (a kernel mount whose
    placeholders a filler fills) against `tilefs mount --fuse` of the same
    lazily pulled image, each from a fresh lazy pull and mount (untimed);
    the read alone is timed (goal: kernel <= FUSE);
  - after every file was read once (all objects fetched): `ls -lR` and
    reading every file, warm, through the kernel lazy mount against a
    kernel mount of the same image pulled whole (goal: <= 1.05x), and the
    FUSE lazy mount against the same reference beside it.
Runs interleaved, order rotated every run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402
from containers import Registry  # noqa: E402

NAME = "lazy_kernel"
TITLE = "a lazily pulled image served by the kernel (fanotify fills) vs FUSE and a full pull"
ORDER = 37
BIG = "big/five-mib"


def run(b) -> None:
    if os.geteuid() != 0:
        b.skip("all", TITLE, "needs root (fanotify pre-content events, kernel mounts)")
        return
    if shutil.which("docker-registry") is None:
        b.skip("all", TITLE, "docker-registry not found (scripts/setup installs it)")
        return
    work = b.tmpdir(NAME)
    reg = Registry(work)
    mnts = {k: work / f"mnt-{k}" for k in ("lazy", "fuse", "full")}
    for m in mnts.values():
        m.mkdir()
    try:
        _run(b, work, reg, mnts)
    finally:
        for m in mnts.values():
            if lib.is_mountpoint(m):
                subprocess.run([b.tilefs, "umount", str(m)], capture_output=True)
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)


def fstype(mnt: Path) -> str | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        if f[4] == str(mnt):
            return line.split(" - ", 1)[1].split()[0]
    return None


def _run(b, work: Path, reg: Registry, mnts: dict) -> None:
    src = work / "src"
    (src / "big").mkdir(parents=True)
    b.progress("lazy_kernel: staging /usr/include ...", final=False)
    if subprocess.run(["cp", "-al", "/usr/include", str(src / "include")], capture_output=True).returncode != 0:
        shutil.rmtree(src / "include", ignore_errors=True)
        subprocess.run(["cp", "-a", "/usr/include", str(src / "include")], check=True)
    (src / BIG).write_bytes(os.urandom(5 << 20))
    store = work / "store"
    subprocess.run([b.tilefs, "build", "-q", "--store", str(store), "--tag", "bench", str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.rmtree(src)
    reg.start(empty=True)
    remote = f"docker://{reg.addr}/bench/include:v1"
    tls = "--tls-verify=false"
    subprocess.run([b.tilefs, "push", "-q", tls, "--store", str(store), "bench", remote], check=True,
                   stdout=subprocess.DEVNULL)
    tag = f"{reg.addr}_bench_include:v1"
    stores = {k: work / f"store-{k}" for k in mnts}

    def mount(k: str, lazy: bool) -> None:
        """A fresh pull (lazy or whole) of the image into store k, mounted at mnt k."""
        m, s = mnts[k], stores[k]
        if lib.is_mountpoint(m):
            subprocess.run([b.tilefs, "umount", str(m)], check=True)
        shutil.rmtree(s, ignore_errors=True)
        subprocess.run([b.tilefs, "pull", "-q", tls, *(["--lazy"] if lazy else []), "--store", str(s), remote],
                       check=True, stdout=subprocess.DEVNULL)
        how = "--fuse" if k == "fuse" else "--kernel"
        subprocess.run([b.tilefs, "mount", "-q", how, "--store", str(s), tag, str(m)], check=True,
                       stdout=subprocess.DEVNULL)

    mount("lazy", True)
    if fstype(mnts["lazy"]) != "overlay":
        b.skip("all", TITLE, f"the lazy mount is {fstype(mnts['lazy'])}, not the kernel's: "
               f"{work} is on a filesystem without fanotify pre-content marks")
        return

    def read_big(k: str) -> list:
        return ["sh", "-c", 'cat "$0" >/dev/null', str(mnts[k] / BIG)]

    b.compare("first-read", "first read of a 5 MiB file from a registry on loopback: kernel lazy mount "
              "(filled through fanotify) vs FUSE lazy mount (fresh lazy pull and mount before each run, untimed)",
              read_big("lazy"), read_big("fuse"), ref_tool="FUSE lazy mount", goal=1.0,
              prepare=lambda role: mount("lazy" if role == "tilefs" else "fuse", True))

    # Every file read once through each lazy mount (all objects fetched),
    # and the same image pulled whole and mounted by the kernel.
    mount("lazy", True)
    mount("fuse", True)
    mount("full", False)
    for k in ("lazy", "fuse"):
        b.progress(f"lazy_kernel: reading every file once through the {k} mount ...", final=False)
        subprocess.run(["sh", "-c", 'find "$0" -type f -print0 | xargs -0 cat >/dev/null', str(mnts[k])], check=True)
    labels = {"lazy": "tilefs kernel lazy (filled)", "full": "kernel, full pull", "fuse": "tilefs FUSE lazy (filled)"}
    work_loads = {
        "ls": ("`ls -lR`", lambda m: ["sh", "-c", 'ls -lR "$0" >/dev/null', str(m)]),
        "read": ("reading every file", lambda m: ["sh", "-c", 'find "$0" -type f -print0 | xargs -0 cat >/dev/null',
                                                  str(m)]),
    }
    for wid, (what, argv) in work_loads.items():
        title = f"after every file was read once, warm: {what}"
        series = {k: lib.Series(labels[k], argv(mnts[k])) for k in ("lazy", "full", "fuse")}
        b.interleave(title, series, cold=False)
        for k, goal in (("lazy", 1.05), ("fuse", None)):
            r = lib.Row(b.section, f"{wid}/{k}", f"{title}: {labels[k]} vs a kernel mount of the image pulled whole",
                        tilefs=series[k], ref=series["full"], ref_tool=labels["full"], goal=goal)
            b.rows.append(r)
            b.progress(lib.summary_line(r))
