"""Section mount: the kernel mount against the alternatives of seed 002.

On the cs9-x86_64-developer tree (64k entries): `ls -lR` cold and warm, the
peak memory of the listing's cgroup, and `stat` of 500/1000/1900 random
entries cold and warm, for
  - tilefs:     `tilefs mount --kernel` (file-backed EROFS + overlayfs, store as data-only layer),
  - composefs:  the reference `mount.composefs` of the reference's image,
  - EROFS:      the image alone, file-backed EROFS (what overlayfs stacks on),
  - ext4:       the same tree unpacked on ext4 (sparse files, devices, owners, times, xattrs).
All four are measured in the same loop, their runs interleaved (order
rotated every run); each row compares tilefs with one of the others.

No object contents are needed: listing and stat never open regular files
(overlayfs guesses st_blocks of a metacopy file from its size instead of
looking up its data), so the store is empty. The section checks that
`ls -lR` succeeds on the tilefs mount before measuring.

Root only (mounts, drop_caches, cgroups). Every mount is undone when the
section ends, also on failure or Ctrl-C.
"""

from __future__ import annotations

import ctypes
import gzip
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "mount"
TITLE = "kernel mount: ls -lR, memory and random stat on the cs9 developer tree (seed 002)"
ORDER = 40

DUMP = "cs9-x86_64-developer.dump.gz"
STAT_COUNTS = (500, 1000, 1900)
SEED = 2023

# config key -> label in the results
LABELS = {
    "tilefs": "tilefs kernel mount",
    "composefs": "mount.composefs",
    "erofs": "plain EROFS",
    "ext4": "ext4 (unpacked)",
}


def run(b) -> None:
    if os.geteuid() != 0:
        b.skip("all", "kernel mount benchmarks", "needs root (mounts, drop_caches, cgroups)")
        return
    have = Path("/proc/filesystems").read_text()
    for fs in ("erofs", "overlay"):
        if fs not in have.split():
            b.skip("all", "kernel mount benchmarks", f"the kernel has no {fs} filesystem")
            return
    src = b.assets / DUMP
    if not src.is_file():
        b.skip("all", "kernel mount benchmarks", f"{src} not found (set TILEFS_ASSETS)")
        return

    work = b.tmpdir(NAME)
    cleanup = Cleanup()
    try:
        _run(b, work, src, cleanup)
    finally:
        cleanup.run(b)


class Cleanup:
    """Undoes mounts (lazily, so nothing can keep them) and removes cgroups."""

    def __init__(self) -> None:
        self.mounts: list[Path] = []
        self.dirs: list[Path] = []

    def mounted(self, mnt: Path) -> None:
        self.mounts.append(mnt)

    def run(self, b) -> None:
        for m in reversed(self.mounts):
            if lib.is_mountpoint(m):
                r = subprocess.run(["umount", "-l", str(m)], capture_output=True, text=True)
                if r.returncode != 0:
                    lib.warn(f"cannot unmount {m}: {r.stderr.strip()}")
        for d in reversed(self.dirs):
            try:
                d.rmdir()
            except OSError:
                pass


def _run(b, work: Path, src: Path, cleanup: Cleanup) -> None:
    tilefs = b.tilefs
    mk = b.tool("mkcomposefs")
    mount_cfs = b.tool("mount.composefs")
    dump = work / DUMP.removesuffix(".gz")
    with gzip.open(src, "rb") as fin, open(dump, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    entries = parse_dump(dump)
    b.progress(f"{len(entries):,} entries in {DUMP}")

    # Images and an empty store.
    t_img = work / "tilefs.img"
    r = subprocess.run([tilefs, "build", "--from-dump", dump, t_img], capture_output=True, text=True)
    if r.returncode != 0:
        b.skip("all", "kernel mount benchmarks", f"tilefs build --from-dump failed: {r.stderr.strip()[-300:]}")
        return
    has_acl = b'"has_acl": true' in subprocess.run([tilefs, "info", "--json", t_img], capture_output=True).stdout
    store = work / "store"
    store.mkdir()
    r_img = None
    if mk and mount_cfs:
        r_img = work / "ref.img"
        r = subprocess.run([mk, "--from-file", dump, r_img], capture_output=True, text=True)
        if r.returncode != 0:
            lib.warn(f"mkcomposefs failed ({r.stderr.strip()[-200:]}): mount.composefs mounts tilefs's image")
            r_img = t_img

    mnts = {k: work / f"mnt-{k}" for k in LABELS}
    for m in mnts.values():
        m.mkdir()
    ready: dict[str, str] = {}  # config -> "" or why not

    # 1. tilefs.
    r = subprocess.run(
        [tilefs, "mount", "--kernel", "--verity", "off", "--store", store, t_img, mnts["tilefs"]],
        capture_output=True,
        text=True,
    )
    cleanup.mounted(mnts["tilefs"])
    ready["tilefs"] = "" if r.returncode == 0 else f"tilefs mount failed: {r.stderr.strip()[-300:]}"
    if not ready["tilefs"]:
        ls = subprocess.run(["ls", "-lR", mnts["tilefs"]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if ls.returncode != 0:
            ready["tilefs"] = f"ls -lR fails on the tilefs mount without objects: {ls.stderr.strip()[-300:]}"
    # 2. The reference.
    if r_img is not None:
        r = subprocess.run([mount_cfs, "-o", f"basedir={store}", r_img, mnts["composefs"]], capture_output=True, text=True)
        cleanup.mounted(mnts["composefs"])
        ready["composefs"] = "" if r.returncode == 0 else f"mount.composefs failed: {r.stderr.strip()[-300:]}"
    else:
        ready["composefs"] = "reference mkcomposefs/mount.composefs not found (set COMPOSEFS_BIN)"
    # 3. EROFS alone, file-backed like the other two, noacl when the image has no ACLs (as they do).
    try:
        mount_erofs_file(t_img, mnts["erofs"], noacl=not has_acl)
        cleanup.mounted(mnts["erofs"])
        ready["erofs"] = ""
    except OSError as e:
        ready["erofs"] = f"EROFS mount failed: {e}"
    # 4. ext4.
    b.progress("unpacking the tree on ext4 ...", final=False)
    t0 = time.monotonic()
    try:
        ext4_root, how = ext4_dir(work, cleanup)
        skipped = materialise(entries, ext4_root)
        mnts["ext4"] = ext4_root
        ready["ext4"] = ""
        b.progress(f"unpacked on ext4 ({how}) in {time.monotonic() - t0:.0f} s")
        ext4_note = f"ext4: {how}"
        if skipped:
            ext4_note += f"; {skipped} xattrs the kernel refuses (user.* on symlinks/devices) left out"
    except (OSError, subprocess.CalledProcessError) as e:
        ready["ext4"] = f"cannot unpack on ext4: {e}"
        ext4_note = ready["ext4"]

    configs = [k for k in LABELS if not ready.get(k)]
    for k in LABELS:
        if ready.get(k):
            b.note(f"{LABELS[k]}: not measured: {ready[k]}")
    if "tilefs" not in configs:
        b.skip("all", "kernel mount benchmarks", ready["tilefs"])
        return

    cold_ok = b.can_drop_caches()
    notes_common = [f"{len(entries):,} entries; store empty (metadata only)"]

    # ls -lR.
    ls_argv = {k: ["ls", "-lR", mnts[k]] for k in configs}
    if cold_ok:
        measure(b, "ls-lR/cold", "ls -lR, cold cache", configs, ls_argv, cold=True)
    else:
        b.skip("ls-lR/cold", "ls -lR, cold cache", "cannot drop the page cache")
    measure(b, "ls-lR/warm", "ls -lR, warm cache", configs, ls_argv, cold=False)

    # Memory of the listing's cgroup.
    memory_row(b, configs, mnts, cleanup)

    # stat of random entries.
    rels = [p for p in (e[0] for e in entries) if p != "/"]
    for n in STAT_COUNTS:
        sample = random.Random(SEED + n).sample(rels, min(n, len(rels)))
        st_argv = {}
        for k in configs:
            # One stat process for all the paths (xargs passes them in one go).
            lst = work / f"stat-{n}-{k}.list"
            lst.write_bytes(b"".join(os.fsencode(str(mnts[k]) + p) + b"\0" for p in sample))
            st_argv[k] = ["xargs", "-0", "-a", lst, "stat", "--format=%i"]
        if cold_ok:
            measure(b, f"stat-{n}/cold", f"stat of {n} random entries, cold cache", configs, st_argv, cold=True)
        measure(b, f"stat-{n}/warm", f"stat of {n} random entries, warm cache", configs, st_argv, cold=False)

    b.note("; ".join(notes_common))
    b.note(ext4_note)
    b.note(
        "all EROFS mounts are file-backed (no loop device); tilefs and mount.composefs stack overlayfs "
        "(metacopy=on, redirect_dir=on, datadir+=store) on it"
    )
    if cold_ok:
        b.note("cold: sync; echo 3 > /proc/sys/vm/drop_caches before every run")


# ---------------------------------------------------------------------------
# Measuring all configurations together.
# ---------------------------------------------------------------------------


def measure(b, id: str, title: str, configs: list[str], argv: dict, *, cold: bool) -> None:
    series = {k: lib.Series(LABELS[k], [str(a) for a in argv[k]]) for k in configs}
    b.interleave(title, series, cold=cold)

    t = series["tilefs"]
    others = [k for k in configs if k != "tilefs"]
    if not others:
        row = lib.Row(b.section, id, title, tilefs=t, cold=cold, notes=["no other configuration could be measured"])
        b.rows.append(row)
    for k in others:
        row = lib.Row(b.section, f"{id}/{k}", f"{title}: vs {LABELS[k]}", tilefs=t, ref=series[k], ref_tool=LABELS[k], cold=cold)
        b.rows.append(row)
        b.progress(lib.summary_line(row))
    parts = [f"{LABELS[k]} {lib.fmt_time(s.median()) if s.ok else 'FAILED'}" for k, s in series.items()]
    b.note(f"{title} (medians): " + ", ".join(parts))


def memory_row(b, configs: list[str], mnts: dict, cleanup: Cleanup) -> None:
    title = "ls -lR, cold cache: peak memory of its cgroup"
    cg = CgroupProbe.find()
    if cg is None:
        b.skip("ls-lR/memory", title, "no cgroup with a memory controller to measure in")
        return
    if not b.can_drop_caches():
        b.skip("ls-lR/memory", title, "cannot drop the page cache")
        return
    peaks: dict[str, list[int]] = {k: [] for k in configs}
    errors: dict[str, str] = {}
    for i in range(b.cold_runs):
        order = configs[i % len(configs):] + configs[: i % len(configs)]
        for k in order:
            if k in errors:
                continue
            b.drop_caches()
            b.progress(f"{title}: {LABELS[k]} run {i + 1}/{b.cold_runs} ...", final=False)
            try:
                peaks[k].append(cg.peak_of(["ls", "-lR", str(mnts[k])], cleanup, timeout=b.timeout))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                errors[k] = str(e)
    value = " · ".join(
        f"{LABELS[k]} {statistics.median(peaks[k]) / 1e6:.0f} MB" if peaks[k] else f"{LABELS[k]} FAILED"
        for k in configs
    )
    vj = {LABELS[k]: {"peak_bytes": peaks[k], "median_bytes": statistics.median(peaks[k]) if peaks[k] else None} for k in configs}
    notes = [f"{cg.describe()}; median of {b.cold_runs} runs, caches dropped before each"]
    notes += [f"{LABELS[k]} failed: {e}" for k, e in errors.items()]
    b.info("ls-lR/memory", title, value, value_json=vj, notes=notes)
    b.note(f"{title} (medians): {value}")


class CgroupProbe:
    """A fresh memory cgroup per run: cgroup v2 (memory.peak) or v1 (memory.max_usage_in_bytes)."""

    def __init__(self, root: Path, v2: bool):
        self.root = root
        self.v2 = v2
        self.n = 0

    @staticmethod
    def find() -> "CgroupProbe | None":
        v1 = v2 = None
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            pre, _, post = line.partition(" - ")
            f = pre.split()
            p = post.split()
            if len(f) < 5 or len(p) < 3:
                continue
            if p[0] == "cgroup2" and v2 is None:
                v2 = Path(f[4])
            elif p[0] == "cgroup" and "memory" in p[2].split(",") and v1 is None:
                v1 = Path(f[4])
        if v2 is not None:
            try:
                if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
                    return CgroupProbe(v2, True)
            except OSError:
                pass
        if v1 is not None and (v1 / "memory.max_usage_in_bytes").exists():
            return CgroupProbe(v1, False)
        return None

    def describe(self) -> str:
        if self.v2:
            return f"cgroup v2 memory.peak (in {self.root})"
        return f"cgroup v1 memory.max_usage_in_bytes (in {self.root}; page cache, dentries and inodes charged to it)"

    def peak_of(self, argv: list[str], cleanup: Cleanup, timeout: float) -> int:
        self.n += 1
        d = self.root / f"tilefs-bench-{os.getpid()}-{self.n}"
        d.mkdir()
        cleanup.dirs.append(d)
        try:
            script = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@" > /dev/null'
            r = subprocess.run(["sh", "-c", script, "sh", str(d), *argv], stderr=subprocess.PIPE, text=True, timeout=timeout)
            if r.returncode != 0:
                raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()[-200:]}")
            name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
            return int((d / name).read_text().split()[0])
        finally:
            # Empty cgroups can go; their charges move to the parent.
            try:
                d.rmdir()
                cleanup.dirs.remove(d)
            except OSError:
                pass


# ---------------------------------------------------------------------------
# Mounts and the ext4 tree.
# ---------------------------------------------------------------------------

_SYS = {"move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432}  # the same on every architecture


def _syscall(name: str, *args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    r = libc.syscall(ctypes.c_long(_SYS[name]), *args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")
    return r


def mount_erofs_file(image: Path, target: Path, noacl: bool) -> None:
    """EROFS straight from the image file (new mount API; mount(8) would use a loop device)."""
    c_long, c_char_p = ctypes.c_long, ctypes.c_char_p
    fs = _syscall("fsopen", c_char_p(b"erofs"), c_long(1))  # FSOPEN_CLOEXEC
    try:
        _syscall("fsconfig", c_long(fs), c_long(1), c_char_p(b"source"), c_char_p(str(image).encode()), c_long(0))
        _syscall("fsconfig", c_long(fs), c_long(0), c_char_p(b"ro"), None, c_long(0))
        if noacl:
            _syscall("fsconfig", c_long(fs), c_long(0), c_char_p(b"noacl"), None, c_long(0))
        _syscall("fsconfig", c_long(fs), c_long(6), None, None, c_long(0))  # FSCONFIG_CMD_CREATE
        m = _syscall("fsmount", c_long(fs), c_long(1), c_long(1))  # CLOEXEC, MOUNT_ATTR_RDONLY
        try:
            # MOVE_MOUNT_F_EMPTY_PATH, AT_FDCWD
            _syscall("move_mount", c_long(m), c_char_p(b""), c_long(-100), c_char_p(str(target).encode()), c_long(4))
        finally:
            os.close(m)
    finally:
        os.close(fs)


def fs_type(p: Path) -> str:
    best, kind = "", "?"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        f = pre.split()
        if len(f) < 5:
            continue
        mp = f[4].replace("\\040", " ")
        if (str(p) == mp or str(p).startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
            best, kind = mp, post.split()[0]
    return kind


def ext4_dir(work: Path, cleanup: Cleanup) -> tuple[Path, str]:
    """A directory on ext4: in the work area when that is ext4, else a loop-mounted ext4 image."""
    if fs_type(work) == "ext4":
        d = work / "ext4-tree"
        d.mkdir()
        return d, f"a directory on the ext4 filesystem holding {work.parent}"
    img = work / "ext4.img"
    with open(img, "wb") as f:
        f.truncate(4 << 30)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    mnt = work / "ext4-mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True, capture_output=True)
    cleanup.mounted(mnt)
    tree = mnt / "tree"
    tree.mkdir()
    return tree, "a fresh 4 GiB ext4 image on a loop device"


# ---------------------------------------------------------------------------
# composefs-dump(5).
# ---------------------------------------------------------------------------


def unescape(s: bytes) -> bytes:
    if b"\\" not in s:
        return s
    out = bytearray()
    i = 0
    while i < len(s):
        c = s[i]
        if c == 0x5C and i + 1 < len(s):
            n = s[i + 1]
            if n == ord("x") and i + 3 < len(s):
                out.append(int(s[i + 2 : i + 4], 16))
                i += 4
                continue
            out.append({ord("n"): 10, ord("r"): 13, ord("t"): 9, 0x5C: 0x5C}.get(n, n))
            i += 2
            continue
        out.append(c)
        i += 1
    return bytes(out)


def parse_dump(path: Path) -> list[tuple]:
    """(path str, size, mode str, uid, gid, rdev, (sec, nsec), payload bytes|None, content bytes|None, xattrs)."""
    out = []
    with open(path, "rb") as f:
        for line in f:
            line = line.rstrip(b"\n")
            if not line:
                continue
            fields = line.split(b" ")
            p = unescape(fields[0]).decode("utf-8", "surrogateescape")
            opt = lambda v: None if v == b"-" else unescape(v)  # noqa: E731
            sec, _, nsec = fields[7].partition(b".")
            xattrs = []
            for x in fields[11:]:
                if not x:
                    continue
                k, _, v = x.partition(b"=")
                xattrs.append((unescape(k).decode("utf-8", "surrogateescape"), unescape(v)))
            out.append(
                (
                    p,
                    int(fields[1]),
                    fields[2].decode(),
                    int(fields[4]),
                    int(fields[5]),
                    int(fields[6]),
                    (int(sec), int(nsec or b"0")),
                    opt(fields[8]),
                    opt(fields[9]),
                    xattrs,
                )
            )
    return out


def materialise(entries: list[tuple], root: Path) -> int:
    """Creates the dump's tree under root: sparse files, owners, modes, ns mtimes, xattrs. Returns xattrs skipped."""
    import stat as st

    skipped = 0
    dirs = []
    r = str(root)
    for p, size, mode_s, uid, gid, rdev, (sec, nsec), payload, content, xattrs in entries:
        full = r if p == "/" else r + p
        if mode_s.startswith("@"):
            os.link(r + payload.decode("utf-8", "surrogateescape"), full)
            continue
        mode = int(mode_s, 8)
        kind = st.S_IFMT(mode)
        if kind == st.S_IFDIR:
            if p != "/":
                os.mkdir(full)
            dirs.append((full, mode, uid, gid, sec, nsec, xattrs))
            continue
        if kind == st.S_IFREG:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if content:
                    os.write(fd, content)
                else:
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
        elif kind == st.S_IFLNK:
            os.symlink(payload, full)
        else:
            os.mknod(full, mode, rdev)
        os.chown(full, uid, gid, follow_symlinks=False)
        if kind != st.S_IFLNK:
            os.chmod(full, st.S_IMODE(mode))
        skipped += set_xattrs(full, xattrs)
        os.utime(full, ns=(sec * 10**9 + nsec, sec * 10**9 + nsec), follow_symlinks=False)
    # Directories last, deepest first, so creating their entries does not change their times.
    for full, mode, uid, gid, sec, nsec, xattrs in reversed(dirs):
        os.chown(full, uid, gid)
        os.chmod(full, st.S_IMODE(mode))
        skipped += set_xattrs(full, xattrs)
        os.utime(full, ns=(sec * 10**9 + nsec, sec * 10**9 + nsec))
    return skipped


def set_xattrs(path: str, xattrs: list) -> int:
    skipped = 0
    for k, v in xattrs:
        try:
            os.setxattr(path, k, v, follow_symlinks=False)
        except OSError:
            skipped += 1
    return skipped
