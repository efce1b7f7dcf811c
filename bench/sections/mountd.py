"""Section mountd: what the mount service gives an unprivileged user.

On the cs9-x86_64-developer tree (64k entries), `ls -lR` run as an
unprivileged user (uid 65534) through
  - delegated: `tilefs mount --delegated` by that user (the mount service's
    kernel mount of a tagged image),
  - kernel:    root's `tilefs mount --kernel` of the same image,
  - fuse:      the FUSE mount the same user gets without the service,
interleaved in one loop, warm and cold; and the latency of a mount (mount +
umount, as the user through the service vs root's own kernel mount).

Root only: it runs the service (on a socket and policy of its own), makes
the mounts, and sets /dev/fuse to 0666 for the rootless FUSE mount while it
runs (put back after). Every mount and the service are undone at the end.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "mountd"
TITLE = "mount service: a user's delegated kernel mount vs root's kernel mount and the user's FUSE mount"
ORDER = 45

DUMP = "cs9-x86_64-developer.dump.gz"
NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
LABELS = {
    "delegated": "delegated mount (user)",
    "kernel": "root's kernel mount",
    "fuse": "user's FUSE mount",
}


def run(b) -> None:
    if os.geteuid() != 0:
        b.skip("all", TITLE, "needs root (runs the mount service)")
        return
    src = b.assets / DUMP
    if not src.is_file():
        b.skip("all", TITLE, f"{src} not found (set TILEFS_ASSETS)")
        return
    if shutil.which("setpriv") is None:
        b.skip("all", TITLE, "setpriv (util-linux) not found")
        return
    work = b.tmpdir(NAME)
    os.chmod(b.tmp, 0o755)
    os.chmod(work, 0o755)
    state = State()
    try:
        _run(b, work, src, state)
    finally:
        state.undo()


class State:
    def __init__(self) -> None:
        self.mounts: list[Path] = []
        self.service: subprocess.Popen | None = None
        self.fuse_mode: int | None = None

    def undo(self) -> None:
        for m in reversed(self.mounts):
            if lib.is_mountpoint(m):
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        if self.service is not None:
            self.service.kill()
            self.service.wait()
        if self.fuse_mode is not None:
            os.chmod("/dev/fuse", self.fuse_mode)


def _run(b, work: Path, src: Path, st: State) -> None:
    tilefs = b.tilefs
    dump = work / DUMP.removesuffix(".gz")
    with gzip.open(src, "rb") as fin, open(dump, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    store = work / "store"
    r = subprocess.run(
        [tilefs, "build", "-q", "--from-dump", dump, "--store", store, "--tag", "cs9"], capture_output=True, text=True
    )
    if r.returncode != 0:
        b.skip("all", TITLE, f"tilefs build failed: {r.stderr.strip()[-300:]}")
        return
    policy = work / "policy.toml"
    policy.write_text(f'[[store]]\npath = "{store}"\nusers = ["{NOBODY}"]\n')
    socket = work / "mountd.sock"
    st.service = subprocess.Popen(
        [tilefs, "mountd", "--socket", socket, "--policy", policy], stderr=subprocess.DEVNULL
    )
    for _ in range(500):
        if socket.exists():
            break
        time.sleep(0.01)
    env = dict(os.environ, TILEFS_MOUNTD_SOCKET=str(socket))
    st.fuse_mode = os.stat("/dev/fuse").st_mode & 0o7777
    os.chmod("/dev/fuse", 0o666)

    mnts = {k: work / f"mnt-{k}" for k in LABELS}
    for m in mnts.values():
        m.mkdir()
        os.chown(m, NOBODY, NOBODY)
        st.mounts.append(m)
    cmds = {
        "delegated": AS_NOBODY + [tilefs, "mount", "--delegated", "--store", store, "cs9", mnts["delegated"]],
        "kernel": [tilefs, "mount", "--kernel", "--store", store, "cs9", mnts["kernel"]],
        "fuse": AS_NOBODY + [tilefs, "mount", "--fuse", "--store", store, "cs9", mnts["fuse"]],
    }
    ready = {}
    for k, argv in cmds.items():
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env)
        ready[k] = "" if r.returncode == 0 else r.stderr.strip()[-300:]
        if ready[k]:
            b.note(f"{LABELS[k]}: not measured: {ready[k]}")
    configs = [k for k in LABELS if not ready[k]]
    if "delegated" not in configs:
        b.skip("all", TITLE, f"the delegated mount failed: {ready['delegated']}")
        return

    # ls exits 1 for the directories the user may not read (the tree has
    # some), 2 for real trouble.
    ls = {k: AS_NOBODY + ["sh", "-c", 'ls -lR "$0" > /dev/null 2>&1; [ $? -le 1 ]', str(mnts[k])] for k in configs}
    if b.can_drop_caches():
        measure(b, "ls-lR/cold", "ls -lR as a user, cold cache", configs, ls, cold=True)
    measure(b, "ls-lR/warm", "ls -lR as a user, warm cache", configs, ls, cold=False)

    # Mount latency: a mount and its umount, by the user through the
    # service and by root itself.
    for k in configs:
        if k != "fuse":
            subprocess.run([tilefs, "umount", mnts[k]] if k == "kernel" else AS_NOBODY + [tilefs, "umount", str(mnts[k])],
                           capture_output=True, env=env)
    lat = {
        "delegated": AS_NOBODY + ["sh", "-c", f'"$0" mount --delegated --store {store} cs9 {mnts["delegated"]} 2>/dev/null && "$0" umount {mnts["delegated"]}', tilefs],
        "kernel": ["sh", "-c", f'"$0" mount --kernel --store {store} cs9 {mnts["kernel"]} 2>/dev/null && "$0" umount {mnts["kernel"]}', tilefs],
    }
    series = {k: lib.Series(LABELS[k], [str(a) for a in v]) for k, v in lat.items()}
    old = os.environ.get("TILEFS_MOUNTD_SOCKET")
    os.environ["TILEFS_MOUNTD_SOCKET"] = str(socket)
    try:
        b.interleave("mount + umount", series, cold=False)
    finally:
        if old is None:
            os.environ.pop("TILEFS_MOUNTD_SOCKET", None)
        else:
            os.environ["TILEFS_MOUNTD_SOCKET"] = old
    row = lib.Row(b.section, "latency", "mount + umount: delegated (user) vs root's kernel mount",
                  tilefs=series["delegated"], ref=series["kernel"], ref_tool=LABELS["kernel"])
    b.rows.append(row)
    b.progress(lib.summary_line(row))
    b.note("ls -lR runs as uid 65534 on every mount; the image's objects are in the store; verity auto (off: no fs-verity here)")


def measure(b, id: str, title: str, configs: list[str], argv: dict, *, cold: bool) -> None:
    series = {k: lib.Series(LABELS[k], [str(a) for a in argv[k]]) for k in configs}
    b.interleave(title, series, cold=cold)
    d = series["delegated"]
    for k in configs:
        if k == "delegated":
            continue
        row = lib.Row(b.section, f"{id}/{k}", f"{title}: vs {LABELS[k]}", tilefs=d, ref=series[k],
                      ref_tool=LABELS[k], cold=cold)
        b.rows.append(row)
        b.progress(lib.summary_line(row))
