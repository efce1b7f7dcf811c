"""Section writable: builds and file trees written inside writable mounts.

A real C build with its sources in the image and its build directory inside
the writable mount: libgit2 as the libgit2-sys crate ships it
(libgit2-sys-0.18.8+1.9.7, fetched from crates.io and checked by SHA-256),
`cmake -S MNT/libgit2 -B MNT/build -DBUILD_TESTS=OFF -DBUILD_CLI=OFF` then
`make -C MNT/build -j2` (libgit2 forces a Debug build: gcc -O0 -g). Then an
untar of a large tree (`$BENCH_UNTAR_TREES`, default /usr/include,
/usr/share/doc and /usr/share/man: tens of thousands of files) into MNT/untar
and `rm -rf` of it. Configurations, measured in the same loop, the order
rotated every round:

  native       the crate's files on the local ext4 (MNT is a plain copy),
  kernel       `tilefs mount --kernel --upper U --work W` (overlayfs),
  fuse-uring   `tilefs mount --fuse --upper U --work W`, FUSE over io_uring,
  fuse-dev     the same with `--no-uring` (/dev/fuse worker threads),
  fuse-halt    fuse-uring with `--idle-poll=off`: idle CPUs halt between
               requests (the default keeps them polling while requests
               flow, where that pays: see `tilefs mount --help`),
  fuse-overlayfs  fuse-overlayfs (lowerdir = a read-only `tilefs mount
               --fuse --no-uring` of the image, upperdir/workdir on ext4):
               the stack users would use today, at the kernel's defaults,
  fuse-user    `tilefs mount --fuse --upper` made and used by uid 65534
               (rootless: no passthrough; fusermount3).

Caches: warm, deliberately. Every configuration does one untimed warm-up
build, untar and rm first, so sources, the tar file and the compiler are in
the page cache and the FUSE servers have verified the objects they serve;
before every timed command the previous outputs are removed (untimed) and
`sync` runs, so no configuration pays for another's writeback. Timed
commands end when the last process exits; dirty data may still be in the
page cache then, as it would be for a developer.

Every build is checked: libgit2.so.* exists, is an ELF file, is within 10%
of the native build's size, and as many .o files were built; every untar is
checked for the right number of entries and bytes. A failed check fails the
configuration (FAILED in its rows) so that a broken mount cannot look fast.

The goals are for what a user gets without tuning the kernel: the fuse
module's enable_uring is off by default, so they apply to the /dev/fuse rows
(fuse-dev, against fuse-overlayfs over /dev/fuse too); the io_uring rows are
shown beside them without a goal.

Root only. The fuse module's enable_uring parameter is set to Y for the
section (for the io_uring rows alone) and put back, and /dev/fuse's mode is opened for the rootless
mount and put back; every mount is undone, also on failure or Ctrl-C.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "writable"
TITLE = "writable mounts: a C build (libgit2) and untar / rm -rf inside tilefs FUSE and kernel overlays vs native ext4 and fuse-overlayfs"
ORDER = 47

CRATE = "libgit2-sys-0.18.8+1.9.7"
CRATE_URL = f"https://static.crates.io/crates/libgit2-sys/{CRATE}.crate"
CRATE_SHA256 = "7f7c568b25d7489bc3fb2988ed69ab111d2944d2f5fec3d5c987fe545ea97b50"
CMAKE_ARGS = ["-DBUILD_TESTS=OFF", "-DBUILD_CLI=OFF"]
JOBS = 2
UNTAR_TREES = os.environ.get("BENCH_UNTAR_TREES") or "/usr/include /usr/share/doc /usr/share/man"
NOBODY = 65534
# Seconds between a round's deletes and the next round's untars (see untar_rows).
SETTLE_S = int(os.environ.get("BENCH_WRITABLE_SETTLE") or 65)
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]

LABELS = {
    "native": "native ext4",
    "kernel": "tilefs kernel overlay",
    "fuse-uring": "tilefs FUSE writable",
    "fuse-dev": "tilefs FUSE writable",
    "fuse-halt": "tilefs FUSE writable, idle CPUs left to halt (--idle-poll=off)",
    "fuse-overlayfs": "fuse-overlayfs on tilefs FUSE",
    "fuse-user": "tilefs FUSE writable, rootless (uid 65534)",
}

# After a build: the library's size, whether it is ELF, and how many objects were built.
CHECK_BUILD = r"""
f=$(ls "$1"/libgit2.so.*.*.* 2>/dev/null | head -n 1)
[ -n "$f" ] || { echo "no libgit2.so.* in $1" >&2; exit 3; }
magic=$(head -c 4 "$f" | od -An -tx1 | tr -d ' \n')
echo "$(stat -c %s "$f") $magic $(find "$1" -name '*.o' | wc -l)"
"""

# After an untar: entries and bytes of regular files under $1 ($1 itself included).
CHECK_TREE = r"""find "$1" -printf '%y %s\n' | awk '{n++} $1=="f"{b+=$2} END{printf "%d %d\n", n, b}'"""


class State:
    """What the section changed, undone in reverse by undo()."""

    def __init__(self, tilefs: str) -> None:
        self.tilefs = tilefs
        self.mounts: list[tuple[Path, list[str]]] = []  # mountpoint, argv prefix to unmount as its owner
        self.fuse_mode: int | None = None

    def undo(self) -> None:
        for m, wrap in reversed(self.mounts):
            if lib.is_mountpoint(m):
                subprocess.run([*wrap, self.tilefs, "umount", str(m)], capture_output=True)
            if lib.is_mountpoint(m):
                subprocess.run(["umount", str(m)], capture_output=True)
            if lib.is_mountpoint(m):
                r = subprocess.run(["umount", "-l", str(m)], capture_output=True, text=True)
                if r.returncode != 0:
                    lib.warn(f"cannot unmount {m}: {r.stderr.strip()}")
        self.mounts.clear()
        if self.fuse_mode is not None:
            os.chmod("/dev/fuse", self.fuse_mode)
            self.fuse_mode = None


def run(b) -> None:
    if os.geteuid() != 0:
        b.skip("all", TITLE, "needs root (kernel overlay, enable_uring, drop to uid 65534)")
        return
    have = Path("/proc/filesystems").read_text().split()
    for fs in ("fuse", "erofs", "overlay"):
        if fs not in have:
            b.skip("all", TITLE, f"the kernel has no {fs} filesystem")
            return
    missing = [t for t in ("cmake", "make", "gcc", "tar") if shutil.which(t) is None]
    if missing:
        b.skip("all", TITLE, f"{', '.join(missing)} not found")
        return
    work = b.tmpdir(NAME)
    os.chmod(b.tmp, 0o755)
    os.chmod(work, 0o755)
    state = State(b.tilefs)
    with lib.FuseUring() as uring:
        try:
            _run(b, work, state, uring)
        finally:
            state.undo()  # before the io_uring switch goes back


# ---------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_crate(b) -> tuple[Path | None, str]:
    """The libgit2-sys .crate file: $LIBGIT2_SYS_CRATE, cargo's download cache,
    the bench's cache (~/.cache/tilefs-bench), else downloaded into it from
    crates.io. Always checked against its SHA-256. Returns (path, how) or (None, why)."""
    cands: list[tuple[Path, str]] = []
    if os.environ.get("LIBGIT2_SYS_CRATE"):
        cands.append((Path(os.environ["LIBGIT2_SYS_CRATE"]), "$LIBGIT2_SYS_CRATE"))
    cargo_home = Path(os.environ.get("CARGO_HOME") or Path.home() / ".cargo")
    cands += [(p, "cargo's registry cache") for p in sorted(cargo_home.glob(f"registry/cache/*/{CRATE}.crate"))]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tilefs-bench"
    cached = cache / f"{CRATE}.crate"
    cands.append((cached, str(cache)))
    for p, how in cands:
        if p.is_file():
            if sha256(p) == CRATE_SHA256:
                return p, f"{p} (from {how}, sha256 checked)"
            b.note(f"{p}: wrong SHA-256, not used")
    if shutil.which("curl") is None:
        return None, f"{CRATE}.crate not found and curl is missing to fetch it (set LIBGIT2_SYS_CRATE)"
    cache.mkdir(parents=True, exist_ok=True)
    part = cached.with_name(cached.name + ".part")
    b.progress(f"downloading {CRATE_URL} ...", final=False)
    r = subprocess.run(["curl", "-fsSL", "--retry", "2", "-o", part, CRATE_URL], capture_output=True, text=True)
    if r.returncode != 0:
        part.unlink(missing_ok=True)
        return None, f"cannot download {CRATE_URL}: {r.stderr.strip()[-200:]} (set LIBGIT2_SYS_CRATE)"
    if sha256(part) != CRATE_SHA256:
        part.unlink(missing_ok=True)
        return None, f"{CRATE_URL}: SHA-256 mismatch (wanted {CRATE_SHA256})"
    os.replace(part, cached)
    return cached, f"{cached} (downloaded from {CRATE_URL}, sha256 checked)"


def tar_counts(tarball: Path) -> tuple[int, int]:
    """What extracting `tarball` into an empty directory makes: the entries
    (parent directories tar creates unasked included) and the bytes of
    regular files (each hardlink counted with its target's size, as find sees it)."""
    names: set[str] = set()
    sizes: dict[str, int] = {}
    total = 0
    with tarfile.open(tarball) as t:
        for m in t:
            name = m.name.rstrip("/")
            parts = name.split("/")
            names.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
            if m.isreg():
                sizes[name] = m.size
                total += m.size
            elif m.islnk():
                total += sizes.get(m.linkname.rstrip("/"), 0)
    return len(names), total


# ---------------------------------------------------------------------------
# Mounts.
# ---------------------------------------------------------------------------


class Config:
    def __init__(self, key: str, root: Path, wrap: list[str]) -> None:
        self.key = key
        self.root = root  # the tree: sources in root/libgit2, build in root/build
        self.wrap = wrap  # argv prefix to run as the mount's user
        self.label = LABELS[key]
        self.transport: str | None = None  # of the tilefs FUSE server involved
        self.pid: int | None = None
        self.error: str | None = None
        self.argv0 = ""  # the peer's binary (fuse-overlayfs)


def mount_all(b, work: Path, state: State, uring: lib.FuseUring, src: Path, image: Path, store: Path) -> dict:
    tilefs = b.tilefs
    cfgs: dict[str, Config] = {}

    def dirs(key: str, owner: int | None = None) -> tuple[Path, Path, Path]:
        m, u, w = work / f"m-{key}", work / f"u-{key}", work / f"w-{key}"
        for d in (m, u, w):
            d.mkdir()
            if owner is not None:
                os.chown(d, owner, owner)
        return m, u, w

    def mount(key: str, argv: list, wrap: list[str], m: Path) -> Config:
        c = Config(key, m, wrap)
        r = subprocess.run([*wrap, *map(str, argv)], capture_output=True, text=True, cwd=work)
        state.mounts.append((m, wrap))
        if r.returncode != 0 or not lib.is_mountpoint(m):
            c.error = f"mount failed: {(r.stderr.strip() or f'exit {r.returncode}')[-300:]}"
        return c

    # native: a plain copy of the crate's files.
    native = work / "m-native"
    subprocess.run(["cp", "-a", src, native], check=True)
    cfgs["native"] = Config("native", native, [])

    m, u, w = dirs("kernel")
    cfgs["kernel"] = mount("kernel", [tilefs, "mount", "--kernel", "--upper", u, "--work", w, "--store", store, image, m],
                           [], m)

    for key, extra in (("fuse-uring", []), ("fuse-dev", ["--no-uring"]), ("fuse-halt", ["--idle-poll=off"])):
        if key in ("fuse-uring", "fuse-halt") and not uring.available:
            b.note(f"{key}: not measured: {uring.why}")
            continue
        m, u, w = dirs(key)
        cfgs[key] = mount(key, [tilefs, "mount", "--fuse", *extra, "--upper", u, "--work", w, "--store", store, image, m],
                          [], m)

    fovl = os.environ.get("FUSE_OVERLAYFS") or shutil.which("fuse-overlayfs")
    if not fovl or not os.access(fovl, os.X_OK):
        b.note("fuse-overlayfs: not measured: not found (set FUSE_OVERLAYFS)")
    else:
        lower = work / "l-fuse-overlayfs"
        lower.mkdir()
        # At the kernel's defaults, as a user would run it: /dev/fuse under it too.
        lc = mount("fuse-overlayfs", [tilefs, "mount", "--fuse", "--no-uring", "--store", store, image, lower], [],
                   lower)
        m, u, w = dirs("fuse-overlayfs")
        if lc.error:
            c = lc
            c.error = f"the read-only tilefs FUSE mount under it: {lc.error}"
        else:
            c = mount("fuse-overlayfs", [fovl, "-o", f"lowerdir={lower},upperdir={u},workdir={w}", m], [], m)
            c.pid = lib.fuse_server_pid(lower)
            c.transport = lib.fuse_transport(c.pid)
        c.root, c.argv0 = m, fovl
        cfgs["fuse-overlayfs"] = c

    if os.environ.get("BENCH_WRITABLE_ROOTLESS", "1") != "0" and shutil.which("setpriv"):
        state.fuse_mode = os.stat("/dev/fuse").st_mode & 0o7777
        os.chmod("/dev/fuse", 0o666)
        m, u, w = dirs("fuse-user", NOBODY)
        cfgs["fuse-user"] = mount("fuse-user",
                                  [tilefs, "mount", "--fuse", "--upper", u, "--work", w, "--store", store, image, m],
                                  AS_NOBODY, m)
    elif shutil.which("setpriv") is None:
        b.note("fuse-user: not measured: setpriv (util-linux) not found")

    for key in ("fuse-uring", "fuse-dev", "fuse-halt", "fuse-user"):
        c = cfgs.get(key)
        if c and not c.error:
            c.pid = lib.fuse_server_pid(c.root)
            c.transport = lib.fuse_transport(c.pid)
    for c in cfgs.values():
        if c.key != "native" and c.key != "kernel":
            tr = c.transport or "transport unknown: server not found"
            c.label += f" ({tr})" if c.key != "fuse-overlayfs" else f" ({tr} under it)"
        if c.error:
            b.note(f"{c.label}: not measured: {c.error}")
    if "fuse-uring" in cfgs and cfgs["fuse-uring"].pid:
        b.note("idle CPU polling of the tilefs FUSE servers (root): " + lib.fuse_idle_poll(cfgs["fuse-uring"].pid))
    if "fuse-uring" in cfgs and cfgs["fuse-uring"].transport == "/dev/fuse":
        b.note("fuse-uring: the server has no io_uring queue threads: the kernel refused FUSE over io_uring")
    return cfgs


# ---------------------------------------------------------------------------
# Timed runs.
# ---------------------------------------------------------------------------


def add(a: lib.Sample, c: lib.Sample) -> lib.Sample:
    return lib.Sample(a.wall + c.wall, a.user + c.user, a.sys + c.sys, max(a.maxrss_kib, c.maxrss_kib), 0)


def timed(b, c: Config, what: str, argv: list, work: Path) -> lib.Sample | None:
    b.progress(f"{what}: {c.label} ...", final=False)
    s = lib.run_once([*c.wrap, *map(str, argv)], timeout=b.timeout, cwd=work)
    if not s.ok:
        c.error = f"{what}: {lib.describe_failure(s, b.timeout)}"
        lines = s.stderr_tail.splitlines()
        if len(s.stderr_tail) >= 3990:  # the tail of a long stderr: its first line is cut
            lines = lines[1:]
        first = next((ln for ln in lines if ln.strip()), "")
        if first and first not in c.error:
            c.error += f" (first error: {first[:200]})"
        b.progress(f"{what}: {c.label} FAILED ({c.error})")
        return None
    return s


def untimed(c: Config, argv: list, work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*c.wrap, *map(str, argv)], capture_output=True, text=True, cwd=work)


def loop(b, cfgs: dict, runs: int, step) -> None:
    """One untimed warm-up of every configuration, then `runs` rounds, the order rotated each round."""
    keys = list(cfgs)
    for i in range(-1, runs):
        order = keys[i % len(keys):] + keys[: i % len(keys)] if i >= 0 else keys
        for k in order:
            if cfgs[k].error is None:
                step(cfgs[k], i >= 0, "warm-up" if i < 0 else f"run {i + 1}/{runs}")


def _run(b, work: Path, state: State, uring: lib.FuseUring) -> None:
    tilefs = b.tilefs
    crate, how = find_crate(b)
    if crate is None:
        b.skip("all", TITLE, how)
        return
    b.note("FUSE over io_uring: " + uring.describe())
    fs = lib.capture(["findmnt", "-no", "FSTYPE,OPTIONS", "-T", str(work)])
    if fs:
        fstype, _, opts = fs.partition(" ")
        b.note(f"native tree, upper and work directories on {fstype} ({opts.strip()})"
               + (": online discard, so freeing blocks waits for the device (rm -rf)" if ",discard" in fs else ""))
    b.note(f"sources: {CRATE} ({how}); image built with tilefs build --store, owned by uid {NOBODY} "
           "(so that the rootless configuration may write in it)")
    unpack = work / "unpack"
    unpack.mkdir()
    subprocess.run(["tar", "-xzf", crate, "-C", unpack], check=True)
    src = unpack / CRATE
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", src], check=True)
    os.chmod(src, 0o755)
    store, image = work / "store", work / "lg2.img"
    r = subprocess.run([tilefs, "build", "-q", "--store", store, src, image], capture_output=True, text=True)
    if r.returncode != 0:
        b.skip("all", TITLE, f"tilefs build failed: {r.stderr.strip()[-300:]}")
        return
    subprocess.run(["chmod", "-R", "a+rX", store], check=True)

    trees = [Path(t) for t in UNTAR_TREES.split()]
    absent = [t for t in trees if not t.is_dir()]
    trees = [t for t in trees if t.is_dir()]
    if absent:
        b.note(f"untar: {', '.join(map(str, absent))} not found, left out")
    tarball = work / "tree.tar"
    want_tree = (0, 0)
    if trees:
        subprocess.run(["tar", "-cf", tarball, "-C", "/", *[str(t).lstrip("/") for t in trees]], check=True)
        os.chmod(tarball, 0o644)
        want_tree = tar_counts(tarball)

    cfgs = mount_all(b, work, state, uring, src, image, store)
    only = os.environ.get("BENCH_WRITABLE_CONFIGS", "").replace(",", " ").split()
    if only:  # native is always measured: every ratio is against it
        cfgs = {k: c for k, c in cfgs.items() if k == "native" or k in only}
    ok = {k: c for k, c in cfgs.items() if not c.error}
    if "native" not in ok:
        b.skip("all", TITLE, "the native copy failed")
        return
    runs = lib.env_int("BENCH_WRITABLE_RUNS", b.runs)
    notes = [f"build: {CRATE}, cmake {' '.join(CMAKE_ARGS)} (libgit2 then builds Debug: gcc -O0 -g), "
             f"make -j{JOBS}; {runs} runs per configuration",
             "build, warm: one untimed warm-up build per configuration first; the build directory removed and "
             "sync before each run (untimed)"]

    parts = (os.environ.get("BENCH_WRITABLE_PARTS") or "build untar").replace(",", " ").split()
    # The build.
    if "build" in parts:
        ser = {k: {p: lib.Series(c.label, []) for p in ("configure", "make", "total")} for k, c in ok.items()}
        want_build: dict = {}

        def build(c: Config, keep: bool, label: str) -> None:
            bdir = c.root / "build"
            r = untimed(c, ["rm", "-rf", bdir], work)
            if r.returncode != 0:
                c.error = f"rm -rf of the build directory: {r.stderr.strip()[-200:]}"
                return
            os.sync()
            conf = timed(b, c, f"cmake configure, {label}", ["cmake", "-S", c.root / "libgit2", "-B", bdir, *CMAKE_ARGS], work)
            if conf is None:
                return
            mk = timed(b, c, f"make -j{JOBS}, {label}", ["make", "-C", bdir, f"-j{JOBS}"], work)
            if mk is None:
                return
            r = untimed(c, ["sh", "-c", CHECK_BUILD, "sh", bdir], work)
            got = r.stdout.split()
            if r.returncode != 0 or len(got) != 3:
                c.error = f"build check: {(r.stderr.strip() or r.stdout.strip())[-200:]}"
                return
            size, magic, objs = int(got[0]), got[1], int(got[2])
            if magic != "7f454c46":
                c.error = f"build check: libgit2.so is not an ELF file (starts {magic})"
                return
            if not want_build:
                want_build.update(size=size, objs=objs, by=c.label)
            elif objs != want_build["objs"] or abs(size - want_build["size"]) > want_build["size"] / 10:
                c.error = (f"build check: {objs} objects and a {size:,}-byte libgit2.so, but {want_build['by']} "
                           f"built {want_build['objs']} and {want_build['size']:,} bytes")
                return
            b.progress(f"{label}: {c.label}: configure {lib.fmt_time(conf.wall)}, make {lib.fmt_time(mk.wall)} "
                       f"({objs} objects, libgit2.so {size:,} bytes)", final=not b._tty)
            if keep:
                s = ser[c.key]
                s["configure"].samples.append(conf)
                s["make"].samples.append(mk)
                s["total"].samples.append(add(conf, mk))

        loop(b, ok, runs, build)
        for k, c in ok.items():
            for p, s in ser[k].items():
                if c.error:
                    s.error, s.samples = c.error, []
                s.argv = ser_argv(c, p)
        for n in notes:
            b.note(n)
        if want_build:
            b.note(f"every build checked: libgit2.so.* an ELF file of {want_build['size']:,} bytes (±10%), "
                   f"{want_build['objs']} objects")
        rows(b, "build", "libgit2 build (cmake configure + make -j2)", ser, cfgs, "total",
             goals={"native": 1.1, "fuse-overlayfs": 0.85})
        rows(b, "configure", "cmake configure of libgit2", ser, cfgs, "configure", refs=("native",))
        rows(b, "make", f"make -j{JOBS} of libgit2", ser, cfgs, "make", refs=("native",))
        for c in ok.values():  # the build trees are not needed any more; a failed build does not skip the untar
            untimed(c, ["rm", "-rf", c.root / "build"], work)
            c.error = None

    # Untar and rm -rf.
    if "untar" not in parts:
        pass
    elif not trees:
        b.skip("untar", "untar and rm -rf", f"none of {UNTAR_TREES} found (set BENCH_UNTAR_TREES)")
    else:
        untar_rows(b, work, cfgs, runs, tarball, trees, want_tree)
    for c in cfgs.values():
        if c.pid and c.key != "fuse-overlayfs":
            hwm = lib.proc_status_kib(c.pid, "VmHWM")
            if hwm:
                b.note(f"{c.label}: server peak RSS {hwm / 1024:.1f} MiB after the section's work")
    if "fuse-overlayfs" in cfgs:
        b.note("fuse-overlayfs: " + describe_peer(cfgs["fuse-overlayfs"].argv0, "FUSE_OVERLAYFS_BUILD")
               + "; run with its defaults (single-threaded: threaded=0), as root")


def untar_rows(b, work: Path, cfgs: dict, runs: int, tarball: Path, trees: list, want_tree: tuple) -> None:
    ok = {k: c for k, c in cfgs.items() if not c.error}
    tser = {k: {p: lib.Series(c.label, []) for p in ("untar", "rm")} for k, c in ok.items()}

    def untar(c: Config, label: str) -> lib.Sample | None:
        dest = c.root / "untar"
        untimed(c, ["rm", "-rf", dest], work)
        os.sync()
        x = timed(b, c, f"untar, {label}", ["sh", "-c", 'mkdir "$1" && exec tar -xf "$2" -C "$1"', "sh", dest, tarball],
                  work)
        if x is None:
            return None
        r = untimed(c, ["sh", "-c", CHECK_TREE, "sh", dest], work)
        got = [int(v) for v in r.stdout.split()] if r.returncode == 0 else []
        want = (want_tree[0] + 1, want_tree[1])  # + the untar directory itself
        if tuple(got) != want:
            c.error = f"untar check: {got or r.stderr.strip()[-200:]} entries/bytes, wanted {want[0]}/{want[1]}"
            return None
        return x

    def rm(c: Config, label: str) -> lib.Sample | None:
        dest = c.root / "untar"
        os.sync()
        x = timed(b, c, f"rm -rf, {label}", ["rm", "-rf", dest], work)
        if x is not None and untimed(c, ["test", "-e", dest], work).returncode == 0:
            c.error = "rm -rf: the tree is still there"
            return None
        return x

    # ext4 scans recently freed inodes when it allocates one for about a
    # minute after a large delete (find_inode_bit / recently_deleted: file
    # creation 0.75-1.3 ms instead of ~20 µs here), so whichever untar
    # followed an rm -rf paid for it. Each round untars in every
    # configuration, then removes every tree, then lets ext4 settle.
    keys = list(ok)
    for i in range(-1, runs):
        order = keys[i % len(keys):] + keys[: i % len(keys)] if i >= 0 else keys
        label = "warm-up" if i < 0 else f"run {i + 1}/{runs}"
        got = {k: untar(ok[k], label) for k in order if ok[k].error is None}
        for k in order:
            if ok[k].error is None and got.get(k) is not None:
                r = rm(ok[k], label)
                if i >= 0 and r is not None:
                    tser[k]["untar"].samples.append(got[k])
                    tser[k]["rm"].samples.append(r)
        os.sync()
        b.progress(f"untar: letting ext4 settle for {SETTLE_S} s after the deletes ...", final=False)
        time.sleep(SETTLE_S)
    for k, c in ok.items():
        for p, s in tser[k].items():
            if c.error:
                s.error, s.samples = c.error, []
            s.argv = [*c.wrap, "tar", "-xf", str(tarball), "-C", str(c.root / "untar")] if p == "untar" \
                else [*c.wrap, "rm", "-rf", str(c.root / "untar")]
    what = f"a tar of {' '.join(map(str, trees))}: {want_tree[0]:,} entries, {want_tree[1] / 1e6:,.0f} MB"
    b.note(f"untar: {what}; warm: one untimed untar + rm -rf per configuration first, the tar file cached, "
           "sync before each timed command; every untar checked (entries and bytes of the extracted tree); "
           f"each round untars in every configuration, then removes every tree, then waits {SETTLE_S} s: "
           "ext4 makes file creation slow for about a minute after a large delete")
    rows(b, "untar", "untar of a large tree", tser, cfgs, "untar", goals={"native": 1.5})
    rows(b, "rm", "rm -rf of that tree", tser, cfgs, "rm", goals={"native": 1.5})


def describe_peer(binary: str, env: str) -> str:
    """A peer's path, version and how it was built: $env if set, else what
    lib.c_build_info (when this harness has it) reads from the binary."""
    ver = lib.capture([binary, "--version"]) or ""
    ver = next((ln for ln in ver.splitlines() if "version" in ln and "fusermount" not in ln), ver.split("\n")[0])
    how = os.environ.get(env)
    if not how and hasattr(lib, "c_build_info"):
        how = lib.c_build_info(binary).how
    return f"{binary} ({ver or 'version unknown'}), built: {how or f'not recorded (set {env})'}"


def ser_argv(c: Config, phase: str) -> list[str]:
    """The commands a phase ran (configure, make, or both: total)."""
    bdir = c.root / "build"
    conf = ["cmake", "-S", str(c.root / "libgit2"), "-B", str(bdir), *CMAKE_ARGS]
    mk = ["make", "-C", str(bdir), f"-j{JOBS}"]
    if phase == "configure":
        return [*c.wrap, *conf]
    if phase == "make":
        return [*c.wrap, *mk]
    return [*c.wrap, "sh", "-c", f"{' '.join(conf)} && {' '.join(mk)}"]


def rows(b, id: str, title: str, ser: dict, cfgs: dict, phase: str, *, goals: dict | None = None,
         refs: tuple = ("native", "kernel", "fuse-overlayfs")) -> None:
    """Each tilefs configuration against each reference configuration of `refs`;
    goals: reference key -> the ratio wanted of the tilefs FUSE row at the kernel's defaults (root, /dev/fuse:
    enable_uring is off unless the administrator turns it on)."""
    goals = goals or {}
    measured = ("fuse-uring", "fuse-dev", "fuse-halt", "fuse-user", "kernel")
    for ref in refs:
        if ref not in ser:
            continue
        for k in measured:
            if k not in ser or k == ref:
                continue
            if ref == "fuse-overlayfs" and k == "kernel":
                continue
            goal = goals.get(ref) if k == "fuse-dev" else None
            t, r = ser[k][phase], ser[ref][phase]
            row = lib.Row(b.section, f"{id}/{k}/vs-{ref}", f"{title}: {cfgs[k].label} vs {cfgs[ref].label}",
                          tilefs=t, ref=r, ref_tool=cfgs[ref].label, goal=goal)
            b.rows.append(row)
            b.progress(lib.summary_line(row))
    # fuse-overlayfs itself against native, for scale.
    if "fuse-overlayfs" in refs and "fuse-overlayfs" in ser and "native" in ser:
        f, n = ser["fuse-overlayfs"][phase], ser["native"][phase]
        if f.ok and n.ok:
            b.info(f"{id}/fuse-overlayfs/vs-native", f"{title}: {cfgs['fuse-overlayfs'].label} vs native ext4",
                   f"{lib.fmt_time(f.median())} vs {lib.fmt_time(n.median())}: {f.median() / n.median():.2f}x",
                   value_json={"fuse_overlayfs_s": f.median(), "native_s": n.median()})
