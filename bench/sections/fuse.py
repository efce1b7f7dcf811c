"""Section fuse: the FUSE mount against the kernel mount of the same image.

Every row compares `tilefs mount --fuse` with another configuration measured
in the same loop, runs interleaved (order rotated every run):
  - kernel:  `tilefs mount --kernel --verity off` of the same image and store,
  - composefs-fuse: the reference's FUSE server (`composefs-fuse -o basedir=`),
    when `$COMPOSEFS_BIN` has it,
  - composefs-rs: composefs-rs's FUSE server (composefs-fuse crate) through
    our harness bench/composefs-rs-fuse, when built (`$COMPOSEFS_RS_FUSE`),
  - native:  the source files themselves on the local filesystem (data rows).

Workloads (issue 5): `ls -lR` of cs9-x86_64-developer cold and warm, `stat` of
500/1000/1900 random entries cold and warm, `lstat` of 1000 random entries
by path timed inside the process with only dentries and inodes dropped
(issue 28: lookups alone), sequential read of a 1 GiB file
(passthrough, and the server's own reads; warm, also an ext4 copy cached in
4 KiB folios as FUSE's page cache is on this kernel), access(2) throughput with 1 and 2
processes (will-it-scale access1 pattern), open(2) + close(2) of the zstd
sources (with passthrough every open asks the server; serving reads itself,
it answers open with ENOSYS and opens stay in the kernel), a C build (zstd's lib, as the
zstd-sys crate ships it, sources in the image, objects written outside), and
the server's RSS. Then each cache setting of the FUSE server switched off in
turn (`TILEFS_FUSE_TUNING`), against the default: ratio > 1 means the
setting saves that much.

Every tilefs FUSE configuration is mounted twice and measured in the same
loop: over io_uring (the fuse module's enable_uring parameter is set to Y for
the section and put back after) and over /dev/fuse (`--no-uring`); each row
names the transport the server really uses, read from its threads (io_uring
queue threads are fuse-q0, fuse-q1, ...). composefs-fuse gets goal 1.0 on
every row (ahead of the C reference's FUSE server). Also: the worker pool
without io_uring (1 and 4 threads against 2), and the cs9 tree ten times
over under /d0../d9 (642k entries): `ls -lR` cold and warm, the server's
RSS against the image size + 32 MiB.

`BENCH_FUSE_PARTS` picks parts (default "metadata lookup tenfold data").

Root only (kernel mounts, drop_caches, passthrough, enable_uring). Every
mount is undone when the section ends, then enable_uring is put back, also
on failure or Ctrl-C.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "fuse"
TITLE = ("FUSE mount (io_uring and /dev/fuse) vs the tilefs kernel mount and composefs-fuse: listing, stat, reads, "
         "access(2), a C build, RSS, cache settings, worker pool, cs9 × 10")
ORDER = 45

DUMP = "cs9-x86_64-developer.dump.gz"
STAT_COUNTS = (500, 1000, 1900)
SEED = 2023
BIG_MIB = int(os.environ.get("BENCH_FUSE_BIG_MIB") or 1024)
ACCESS_CALLS = int(os.environ.get("BENCH_FUSE_ACCESS_CALLS") or 2_000_000)
OPEN_ROUNDS = int(os.environ.get("BENCH_FUSE_OPEN_ROUNDS") or 100)
SERVER_START_TIMEOUT = 30  # seconds for a foreground FUSE server to mount

ACCESS_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
/* will-it-scale access1: access(2) on one file in a loop. */
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    for (long i = 0; i < n; i++)
        if (access(argv[2], R_OK) != 0) { perror(argv[2]); return 1; }
    return 0;
}
"""

LSTAT_C = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
/* lstat(2) of every path listed in argv[2] (one a line) under the root
   argv[1]; prints the nanoseconds the calls took, the process's start and
   the list's reading left out. */
int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *f = fopen(argv[2], "r");
    if (!f) { perror(argv[2]); return 1; }
    size_t cap = 1024, n = 0;
    char **v = malloc(cap * sizeof *v), line[8192];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (n == cap) v = realloc(v, (cap *= 2) * sizeof *v);
        if (asprintf(&v[n++], "%s%s", argv[1], line) < 0) return 1;
    }
    struct timespec a, b;
    struct stat st;
    long bad = 0;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (size_t i = 0; i < n; i++)
        if (lstat(v[i], &st) != 0) bad++;
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (bad) { fprintf(stderr, "%ld of %zu lstat calls failed\n", bad, n); return 1; }
    printf("%ld\n", (b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec));
    return 0;
}
"""

# The least any FUSE server can do for a path walk, to measure what FUSE
# itself costs: every name is a directory with a new inode number, nothing is
# looked up. libfuse's low-level API, one thread over /dev/fuse. It holds the
# 0 µs CPU latency request that tilefs's server holds while requests flow
# (--idle-poll), so that both meet the same CPUs.
NULLFS_C = r"""
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
static fuse_ino_t next = 2;
static void fill(struct stat *st, fuse_ino_t ino) {
    memset(st, 0, sizeof *st);
    st->st_ino = ino; st->st_mode = S_IFDIR | 0755; st->st_nlink = 2;
}
static void lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    e.ino = next++; e.attr_timeout = e.entry_timeout = 86400;
    fill(&e.attr, e.ino);
    fuse_reply_entry(req, &e);
}
static void getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct stat st;
    fill(&st, ino);
    fuse_reply_attr(req, &st, 86400);
}
static const struct fuse_lowlevel_ops ops = { .lookup = lookup, .getattr = getattr };
int main(int argc, char **argv) {
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    struct fuse_cmdline_opts o;
    if (fuse_parse_cmdline(&args, &o) != 0 || !o.mountpoint) return 2;
    int qos = open("/dev/cpu_dma_latency", O_WRONLY), zero = 0;
    if (qos >= 0 && write(qos, &zero, sizeof zero) != sizeof zero) return 1;
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se || fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, o.mountpoint) != 0) return 1;
    int r = fuse_session_loop(se);
    fuse_session_unmount(se);
    return r != 0;
}
"""

OPEN_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* open(2) and close(2) of every file listed in $3 (relative to $2), $1 rounds. */
int main(int argc, char **argv) {
    long rounds = atol(argv[1]);
    FILE *f = fopen(argv[3], "r");
    if (!f) { perror(argv[3]); return 1; }
    char **paths = NULL; size_t n = 0; char line[4096];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        paths = realloc(paths, (n + 1) * sizeof *paths);
        paths[n] = malloc(strlen(argv[2]) + strlen(line) + 2);
        sprintf(paths[n++], "%s/%s", argv[2], line);
    }
    for (long r = 0; r < rounds; r++)
        for (size_t i = 0; i < n; i++) {
            int fd = open(paths[i], O_RDONLY);
            if (fd < 0) { perror(paths[i]); return 1; }
            close(fd);
        }
    return 0;
}
"""

FOLIOS_C = r"""
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
/* For each file: how many of its cached pages sit in large folios (compound
 * pages), from /proc/self/pagemap and /proc/kpageflags (root). Maps the file
 * and touches each page, so every page must already be cached to stay so. */
int main(int argc, char **argv) {
    int pm = open("/proc/self/pagemap", O_RDONLY), kf = open("/proc/kpageflags", O_RDONLY);
    if (pm < 0 || kf < 0) { perror("/proc/kpageflags"); return 1; }
    for (int a = 1; a < argc; a++) {
        int fd = open(argv[a], O_RDONLY);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) < 0) { perror(argv[a]); return 1; }
        size_t n = st.st_size / 4096, large = 0, present = 0;
        volatile char *m = mmap(0, n * 4096, PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) { perror(argv[a]); return 1; }
        for (size_t i = 0; i < n; i++) {
            uint64_t e = 0, f = 0;
            (void)m[i * 4096];
            if (pread(pm, &e, 8, ((uintptr_t)m / 4096 + i) * 8) != 8 || !(e >> 63)) continue;
            present++;
            if (pread(kf, &f, 8, (e & ((1ULL << 55) - 1)) * 8) == 8 && (f & (3ULL << 15))) large++;
        }
        printf("%zu %zu\n", present, large);
        munmap((void *)m, n * 4096);
        close(fd);
    }
    return 0;
}
"""

BUILD_SH = r"""#!/bin/sh
# $1: zstd's lib directory, $2: output directory. Every .c but legacy/, two at a time.
set -e
rm -rf "$2"; mkdir -p "$2"
cd "$1"
find . -name '*.c' ! -path './legacy/*' | sort | \
  xargs -P2 -I{} sh -c 'gcc -O0 -DZSTD_LEGACY_SUPPORT=0 -c "$1" -o "$2/$(echo "$1" | tr / _).o"' sh {} "$2"
"""


class Cleanup:
    """Undoes mounts (tilefs umount, then lazily) when the section ends, after
    stopping the servers started in the foreground (SIGTERM, then SIGKILL)."""

    def __init__(self, tilefs: str) -> None:
        self.tilefs = tilefs
        self.mounts: list[Path] = []
        self.servers: list[subprocess.Popen] = []

    def run(self) -> None:
        for p in self.servers:
            if p.poll() is None:
                p.terminate()  # composefs-rs-fuse unmounts and exits
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for m in reversed(self.mounts):
            if lib.is_mountpoint(m):
                subprocess.run([self.tilefs, "umount", str(m)], capture_output=True)
            if lib.is_mountpoint(m):
                r = subprocess.run(["umount", "-l", str(m)], capture_output=True, text=True)
                if r.returncode != 0:
                    lib.warn(f"cannot unmount {m}: {r.stderr.strip()}")


# The transports of the tilefs FUSE server: key, what the rows call it, flags.
TRANSPORTS = (("uring", "io_uring", []), ("dev", "/dev/fuse", ["--no-uring"]))


class Mounts:
    def __init__(self, b, work: Path, cleanup: Cleanup, uring: lib.FuseUring) -> None:
        self.b = b
        self.work = work
        self.cleanup = cleanup
        self.uring = uring
        self.n = 0
        self.idle_poll_noted = False

    def fuse_transports(self, key: str, what: str, store: Path, image: Path, tuning: str = "",
                        extra=()) -> list[tuple[str, Path, str, str]]:
        """`tilefs mount --fuse` once per transport (io_uring where it can be
        turned on, and --no-uring): [(key/uring or key/dev, mountpoint, error,
        label)]. The label names the transport the server really uses, from
        its threads (io_uring queue threads are fuse-q0, fuse-q1, ...)."""
        out = []
        for t, name, flags in TRANSPORTS:
            if t == "uring" and not self.uring.available:
                continue
            mnt, err = self.fuse(f"{key}-{t}".replace(",", "+"), store, image, tuning=tuning, extra=[*flags, *extra])
            used = lib.fuse_transport(lib.fuse_server_pid(mnt)) if not err else None
            if used is None:
                label = f"{what} ({name}?: server not found)"
            elif used != name:
                label = f"{what} ({used}: {name} refused)"
                self.b.note(f"{key}: asked for {name}, the server uses {used}")
            else:
                label = f"{what} ({used})"
            out.append((f"{key}/{t}", mnt, err, label))
            if used and not self.idle_poll_noted:
                self.idle_poll_noted = True
                self.b.note("idle CPU polling of the tilefs FUSE servers: "
                            + lib.fuse_idle_poll(lib.fuse_server_pid(mnt)))
        return out

    def _mnt(self, name: str) -> Path:
        self.n += 1
        m = self.work / f"mnt-{self.n}-{name}"
        m.mkdir()
        return m

    def fuse(self, name: str, store: Path, image: Path, tuning: str = "", extra=()) -> tuple[Path, str]:
        """One `tilefs mount --fuse`; with io_uring available its default transport is io_uring."""
        m = self._mnt(name)
        env = dict(os.environ, TILEFS_FUSE_TUNING=tuning)
        r = subprocess.run(
            [self.b.tilefs, "mount", "--fuse", *extra, "--store", store, image, m], capture_output=True, text=True, env=env
        )
        self.cleanup.mounts.append(m)
        return m, "" if r.returncode == 0 else f"tilefs mount --fuse failed: {r.stderr.strip()[-300:]}"

    def kernel(self, name: str, store: Path, image: Path) -> tuple[Path, str]:
        m = self._mnt(name)
        r = subprocess.run(
            [self.b.tilefs, "mount", "--kernel", "--verity", "off", "--store", store, image, m],
            capture_output=True,
            text=True,
        )
        self.cleanup.mounts.append(m)
        return m, "" if r.returncode == 0 else f"tilefs mount --kernel failed: {r.stderr.strip()[-300:]}"

    def composefs_fuse(self, name: str, store: Path, image: Path) -> tuple[Path, str]:
        tool = self.b.tool("composefs-fuse")
        if not tool:
            return Path("/nonexistent"), "reference composefs-fuse not found (set COMPOSEFS_BIN)"
        m = self._mnt(name)
        r = subprocess.run([tool, "-o", f"source={image},basedir={store}", m], capture_output=True, text=True)
        self.cleanup.mounts.append(m)
        if r.returncode != 0 or not lib.is_mountpoint(m):
            return m, f"composefs-fuse failed: {r.stderr.strip()[-300:]}"
        return m, ""

    def null_fuse(self, name: str) -> tuple[Path, str]:
        """The do-nothing FUSE server of NULLFS_C (built here with libfuse 3), serving in the foreground until
        Cleanup stops it (libfuse unmounts on SIGTERM)."""
        pc = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
        if pc.returncode != 0:
            return Path("/nonexistent"), "libfuse 3 not found (pkg-config fuse3; Debian: libfuse3-dev)"
        tool = compile_c(shutil.which("gcc"), self.work / "nullfs", NULLFS_C, pc.stdout.split())
        if tool is None:
            return Path("/nonexistent"), "gcc not found, or it failed to build the do-nothing server"
        m = self._mnt(name)
        return m, self.serve("the do-nothing server", [tool, "-f", "-o", "default_permissions,fsname=tilefs-bench-null"], m)

    def serve(self, what: str, argv: list, m: Path) -> str:
        """Starts a FUSE server that serves `m` in the foreground (argv, then m), for Cleanup to stop, and waits for
        the mount: "" once mounted, else why not."""
        log = self.work / f"{m.name}.log"
        with open(log, "wb") as err:
            p = subprocess.Popen([*argv, m], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True)
        self.cleanup.servers.append(p)
        self.cleanup.mounts.append(m)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while not lib.is_mountpoint(m):
            if p.poll() is not None:
                return f"{what} exited ({p.returncode}): {log.read_text(errors='replace').strip()[-300:]}"
            if time.monotonic() > deadline:
                return f"{what}: {m} not mounted after {SERVER_START_TIMEOUT} s"
            time.sleep(0.05)
        return ""

    def composefs_rs_fuse(self, name: str, store: Path, image: Path, dump: Path | None = None) -> tuple[Path, str]:
        """composefs-rs's FUSE server, through bench/composefs-rs-fuse (it serves in the foreground: started in
        the background, stopped by Cleanup). composefs-rs reads no regular file without an fs-verity digest:
        given the dump IMAGE was built from, and when that dump has such files, it serves an image of the dump
        with a made-up digest for each of them instead (the same tree; for metadata rows, the store needs none)."""
        tool = composefs_rs_fuse_tool()
        if not tool:
            return Path("/nonexistent"), (
                "composefs-rs-fuse not found (set COMPOSEFS_RS_FUSE, or put it in COMPOSEFS_BIN; build it with "
                "cargo build --release --manifest-path bench/composefs-rs-fuse/Cargo.toml)"
            )
        if dump is not None:
            dump_rs = self.work / f"{name}.dump"
            if with_digests(dump, dump_rs):
                image = self.work / f"{name}.img"
                r = subprocess.run([self.b.tilefs, "build", "--from-dump", dump_rs, image],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    return Path("/nonexistent"), f"tilefs build for composefs-rs failed: {r.stderr.strip()[-300:]}"
                self.b.note(f"composefs-rs FUSE: serves {image.name}, built from the same dump with an fs-verity "
                            "digest made up for each file that has none (composefs-rs reads no file without one)")
        m = self._mnt(name)
        err = self.serve("composefs-rs-fuse", [tool, image, store], m)
        if err:
            return m, err
        self.b.note("composefs-rs FUSE also lists the 256 overlay whiteouts 00–ff of a composefs image's root, "
                    "which the other mounts hide")
        return m, ""


def composefs_rs_fuse_tool() -> str | None:
    """bench/composefs-rs-fuse's binary: $COMPOSEFS_RS_FUSE, else composefs-rs-fuse in $COMPOSEFS_BIN (else PATH)."""
    p = os.environ.get("COMPOSEFS_RS_FUSE")
    if not p:
        cdir = os.environ.get("COMPOSEFS_BIN")
        p = str(Path(cdir) / "composefs-rs-fuse") if cdir else shutil.which("composefs-rs-fuse")
    return p if p and os.path.isfile(p) and os.access(p, os.X_OK) else None


def with_digests(src: Path, dst: Path) -> int:
    """Copies the dump src to dst, giving each regular file with a payload but no fs-verity digest a made-up one
    (sha256 of its payload, payload XX/YYYY... as in a digest store). Returns how many it changed."""
    changed = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for line in fin:
            f = line.rstrip(b"\n").split(b" ")
            # path size mode nlink uid gid rdev mtime payload content digest xattrs...; mode "@..." is a hardlink
            if (len(f) >= 11 and not f[2].startswith(b"@") and int(f[2], 8) & 0o170000 == 0o100000
                    and f[8] != b"-" and f[10] == b"-"):
                d = hashlib.sha256(f[8]).hexdigest().encode()
                f[8], f[10] = d[:2] + b"/" + d[2:], d
                line = b" ".join(f) + b"\n"
                changed += 1
            fout.write(line)
    return changed


# ---------------------------------------------------------------------------
# Measuring several configurations together.
# ---------------------------------------------------------------------------


def read_file(path: Path, small_folios: bool = False) -> None:
    """Reads `path` into the page cache. With small_folios, first drops its
    cached pages and reads without readahead, which fills its page cache
    with 4 KiB folios, as FUSE's is on kernels without large folios for
    FUSE."""
    with open(path, "rb", buffering=0) as f:
        if small_folios:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        while f.read(1 << 20):
            pass


def measure(b, title: str, argv: dict, *, cold: bool, runs: int | None = None, after_drop=None,
            labels: dict | None = None) -> dict:
    """Runs every configuration's argv, interleaved; returns their Series (named by labels[key])."""
    series = {k: lib.Series((labels or {}).get(k, k), [str(a) for a in argv[k]]) for k in argv}
    return b.interleave(title, series, cold=cold, runs=runs, after_drop=after_drop)


def row(b, id: str, title: str, t: lib.Series, ref: lib.Series | None, ref_label: str, *, cold: bool,
        goal: float | None = None, nbytes: int | None = None, notes=()) -> None:
    t.tool = "tilefs FUSE" if t.tool == "fuse" else t.tool
    r = lib.Row(b.section, id, title, tilefs=t, ref=ref, ref_tool=ref_label, goal=goal, cold=cold, nbytes=nbytes,
                notes=list(notes))
    if ref is None:
        r.notes.append(f"{ref_label}: not measured")
    b.rows.append(r)
    b.progress(lib.summary_line(r))


# ---------------------------------------------------------------------------
# The section.
# ---------------------------------------------------------------------------


def run(b) -> None:
    if os.geteuid() != 0:
        b.skip("all", "FUSE mount benchmarks", "needs root (kernel mounts for the ratios, drop_caches)")
        return
    have = Path("/proc/filesystems").read_text().split()
    for fs in ("fuse", "erofs", "overlay"):
        if fs not in have:
            b.skip("all", "FUSE mount benchmarks", f"the kernel has no {fs} filesystem")
            return
    work = b.tmpdir(NAME)
    cleanup = Cleanup(b.tilefs)
    with lib.FuseUring() as uring:
        try:
            b.note("FUSE over io_uring: " + uring.describe()
                   + ("" if uring.available else ": the io_uring rows are left out"))
            cfs = b.tool("composefs-fuse")
            if cfs:
                how = b.facts.get("reference_build") or os.environ.get("COMPOSEFS_BUILD") \
                    or "not recorded (set COMPOSEFS_BUILD)"
                b.note(f"composefs-fuse (the C reference's FUSE server, libfuse 3, multi-threaded): {cfs}; built: {how}")
            m = Mounts(b, work, cleanup, uring)
            parts = (os.environ.get("BENCH_FUSE_PARTS") or "metadata lookup tenfold data").replace(",", " ").split()
            if "metadata" in parts or "lookup" in parts:
                metadata_rows(b, work, m, parts)
            if "tenfold" in parts:
                tenfold_rows(b, work, m)
            if "data" in parts:
                data_rows(b, work, m)
        finally:
            cleanup.run()  # every io_uring mount is gone before enable_uring goes back


LABELS = {"kernel": "tilefs kernel mount", "composefs-fuse": "composefs-fuse (reference)",
          "composefs-rs": "composefs-rs FUSE (composefs-fuse crate)", "native": "native (ext4)"}


def rows_for(b, id: str, title: str, s: dict, fuse_keys: list, refs: dict, label: dict, *, cold: bool,
             nbytes: int | None = None, notes=(), transports: bool = True) -> None:
    """A row for each tilefs FUSE configuration of fuse_keys against each
    reference of refs (key -> goal or None) measured in `s`, and with
    transports, io_uring against /dev/fuse for each pair of fuse_keys that
    differ only in it."""
    for fk in fuse_keys:
        if fk not in s:
            continue
        for rk, goal in refs.items():
            if rk not in s:  # not mounted (said in a note) or not measured here
                continue
            row(b, f"{id}/{fk}/{rk}", f"{title}: {label[fk]} vs {label[rk]}", s[fk], s[rk], label[rk],
                cold=cold, goal=goal, nbytes=nbytes, notes=notes)
        base = fk.rsplit("/", 1)[0]
        if transports and fk.endswith("/uring") and f"{base}/dev" in s:
            row(b, f"{id}/{base}/uring-vs-dev", f"{title}: {label[fk]} vs {label[base + '/dev']}", s[fk],
                s[f"{base}/dev"], label[base + "/dev"], cold=cold, nbytes=nbytes, notes=notes)


def server_rss(b, id: str, what: str, mnt: Path, label: str, image_size: int) -> None:
    """The FUSE server's peak and current RSS, against the goal image + 32 MiB."""
    pid = lib.fuse_server_pid(mnt)
    if not pid:
        b.note(f"{label}: the server's process was not found: RSS not measured")
        return
    hwm, rss = lib.proc_status_kib(pid, "VmHWM"), lib.proc_status_kib(pid, "VmRSS")
    if not hwm or not rss:
        return
    limit = image_size / 1024 + 32 * 1024
    verdict = "✓ met" if hwm <= limit else "✗ **missed**"
    b.info(id, f"{label}: server RSS after {what} (peak / now)",
           f"{hwm / 1024:.1f} MiB / {rss / 1024:.1f} MiB; goal ≤ image + 32 MiB = {limit / 1024:.1f} MiB {verdict}",
           value_json={"vm_hwm_kib": hwm, "vm_rss_kib": rss, "image_bytes": image_size, "goal_kib": round(limit),
                       "goal_met": hwm <= limit})


def metadata_rows(b, work: Path, m: Mounts, parts: list) -> None:
    src = b.assets / DUMP
    if not src.is_file():
        b.skip("cs9", "ls -lR and stat on cs9-x86_64-developer", f"{src} not found (set TILEFS_ASSETS)")
        return
    dump = work / DUMP.removesuffix(".gz")
    with gzip.open(src, "rb") as fin, open(dump, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    paths = []
    with open(dump, "rb") as f:
        for line in f:
            p = line.split(b" ", 1)[0].decode("utf-8", "surrogateescape")
            if p != "/" and "\\" not in p:
                paths.append(p)
    image = work / "cs9.img"
    r = subprocess.run([b.tilefs, "build", "--from-dump", dump, image], capture_output=True, text=True)
    if r.returncode != 0:
        b.skip("cs9", "cs9 benchmarks", f"tilefs build failed: {r.stderr.strip()[-300:]}")
        return
    store = work / "store-empty"
    store.mkdir()
    image_size = image.stat().st_size
    # One copy of the image per mount: composefs-fuse mmaps its image, and a
    # mapped file's pages survive drop_caches, so a shared file would leave
    # the kernel mount's image cached in the "cold" rows.
    images = {}
    for k in ("kernel", "composefs-fuse"):
        images[k] = work / f"cs9-{k}.img"
        shutil.copyfile(image, images[k])
    mnt, why, label = {}, {}, dict(LABELS)
    for k, mp, err, lab in m.fuse_transports("fuse", "tilefs FUSE", store, image):
        mnt[k], why[k], label[k] = mp, err, lab
    fuse_keys = list(mnt)
    mnt["kernel"], why["kernel"] = m.kernel("kernel", store, images["kernel"])
    mnt["composefs-fuse"], why["composefs-fuse"] = m.composefs_fuse("cfs", store, images["composefs-fuse"])
    mnt["composefs-rs"], why["composefs-rs"] = m.composefs_rs_fuse("cfsrs", store, image, dump=dump)
    for k in mnt:
        if why[k]:
            b.note(f"{label[k]}: not measured: {why[k]}")
    fuse_keys = [k for k in fuse_keys if not why[k]]
    if not fuse_keys:
        b.skip("cs9", "cs9 benchmarks", "; ".join(why[k] for k in mnt if k.startswith("fuse/")))
        return
    configs = [k for k in mnt if not why[k]]
    main = fuse_keys[0]
    goals = {"ls-lR/cold": 1.5, "ls-lR/warm": 1.2, "stat": 1.3, "stat-dentries": 1.5}
    b.note(f"cs9-x86_64-developer: {len(paths):,} entries, image {image_size / 1e6:.1f} MB, store empty (metadata only)")

    def compare_all(id: str, title: str, argv_of, cold: bool, goal: float | None, after_drop=None) -> dict:
        argv = {k: argv_of(mnt[k]) for k in configs}
        s = measure(b, title, argv, cold=cold, after_drop=after_drop, labels=label)
        # Ahead of the C reference's FUSE server on every row: goal 1.0 against it.
        rows_for(b, id, title, s, fuse_keys, {"kernel": goal, "composefs-fuse": 1.0, "composefs-rs": None}, label,
                 cold=cold)
        return s

    if b.can_drop_caches() and "lookup" in parts:
        lookup_rows(b, work, m, {k: mnt[k] for k in configs}, paths, images, image, fuse_keys, label)
    if "metadata" not in parts:
        return

    if b.can_drop_caches():
        compare_all("ls-lR/cold", "ls -lR cs9, cold cache", lambda p: ["ls", "-lR", p], True, goals["ls-lR/cold"])
    compare_all("ls-lR/warm", "ls -lR cs9, warm cache", lambda p: ["ls", "-lR", p], False, goals["ls-lR/warm"])
    for n in STAT_COUNTS:
        sample = random.Random(SEED + n).sample(paths, min(n, len(paths)))
        argv_of = lambda p, sample=sample: ["stat", "--format=%i", *[str(p) + x for x in sample]]  # noqa: E731
        if b.can_drop_caches():
            compare_all(f"stat-{n}/cold", f"stat of {n} random entries, cold cache", argv_of, True, goals["stat"])
            # Dentries and inodes dropped, image file read back into the page
            # cache: only the lookups are cold. The FUSE server does not use
            # its image file after mounting, so this helps only the others.
            compare_all(f"stat-{n}/dentries", f"stat of {n} random entries, cold dentries, image file cached",
                        argv_of, True, goals["stat-dentries"], after_drop=lambda k: read_file(images.get(k, image)))
        compare_all(f"stat-{n}/warm", f"stat of {n} random entries, warm cache", argv_of, False, goals["stat"])

    for k in fuse_keys:
        server_rss(b, f"rss/{k}", "the cs9 rows", mnt[k], label[k], image_size)

    # Each cache setting switched off, on the listing and stat rows, with the
    # default transport (io_uring where available).
    variants = [
        ("no-readdirplus", "without readdirplus", ["ls-warm", "ls-cold"]),
        ("readdirplus-auto", "readdirplus auto", ["ls-cold"]),
        ("opendir", "opendir answered (FOPEN_CACHE_DIR | KEEP_CACHE), not ENOSYS", ["ls-warm", "ls-cold"]),
        ("opendir,no-cache-dir", "opendir answered, without kept directory caches", ["ls-warm"]),
        ("no-symlinks", "without FUSE_CACHE_SYMLINKS", ["ls-warm"]),
        ("no-selinux-enotsup", "security.selinux answered ENODATA", ["ls-warm"]),
        ("no-negative", "without negative entries", ["missing"]),
        ("--idle-poll=off", "idle CPUs left to halt (--idle-poll=off)", ["stat-cold", "ls-cold"]),
    ]
    sample = random.Random(SEED).sample(paths, 1000)
    missing = [x + ".missing" for x in random.Random(SEED + 1).sample(paths, 1000)]
    work_of = {
        "ls-warm": ("ls -lR, warm", lambda p: ["ls", "-lR", p], False),
        "ls-cold": ("ls -lR, cold", lambda p: ["ls", "-lR", p], True),
        "stat-cold": ("stat of 1000, cold", lambda p: ["stat", "--format=%i", *[str(p) + x for x in sample]], True),
        "missing": ("stat of 1000 missing names, warm",
                    lambda p: ["sh", "-c", 'for i in 1 2 3 4 5; do stat "$@" 2>/dev/null; done; true', "sh",
                               *[str(p) + x for x in missing]], False),
    }
    tr = label[main][label[main].rindex("("):]
    for tuning, what, works in variants:
        env, flags = variant_args(tuning)
        vm, err = m.fuse(tuning.replace(",", "+"), store, image, tuning=env,
                         extra=[*flags, *([] if main.endswith("/uring") else ["--no-uring"])])
        if err:
            b.note(f"{tuning}: not measured: {err}")
            continue
        for w in works:
            name, argv_of, cold = work_of[w]
            if cold and not b.can_drop_caches():
                continue
            s = measure(b, f"{name}: {what}", {"default": argv_of(mnt[main]), tuning: argv_of(vm)}, cold=cold,
                        runs=3)
            row(b, f"setting/{tuning}/{w}", f"setting: {what} vs default {tr} — cs9 {name}", s[tuning], s["default"],
                f"FUSE default {tr}", cold=cold)
        subprocess.run([b.tilefs, "umount", vm], capture_output=True)

    # Worker pool sizing without io_uring (with io_uring there is one queue
    # per CPU and no pool): 1 and 4 /dev/fuse worker threads against 2.
    pool = {}
    for n in (2, 1, 4):
        vm, err = m.fuse(f"threads-{n}", store, image, extra=["--no-uring", "--threads", str(n)])
        if err:
            b.note(f"--threads {n}: not measured: {err}")
        else:
            pool[n] = vm
    if 2 in pool:
        for n in (1, 4):
            if n not in pool:
                continue
            for w in ("ls-cold", "stat-cold"):
                name, argv_of, cold = work_of[w]
                if cold and not b.can_drop_caches():
                    continue
                s = measure(b, f"{name}: {n} vs 2 worker threads", {"2": argv_of(pool[2]), str(n): argv_of(pool[n])},
                            cold=cold, runs=3)
                row(b, f"threads/{n}-vs-2/{w}", f"worker pool: {n} vs 2 /dev/fuse threads (no io_uring) — cs9 {name}",
                    s[str(n)], s["2"], "2 threads (/dev/fuse)", cold=cold)
    for vm in pool.values():
        subprocess.run([b.tilefs, "umount", vm], capture_output=True)
    b.note("setting rows: ratio = time with the setting off / time with the default (> 1: the setting helps); "
           "3 runs each (7 for the read with the store cached); worker pool rows: ratio = N threads / 2 threads")


# ---------------------------------------------------------------------------
# The cs9 tree ten times over (642k entries).
# ---------------------------------------------------------------------------

LOOKUP_RUNS = 11


def lookup_rows(b, work: Path, m: Mounts, mnt: dict, paths: list, images: dict, image: Path, fuse_keys: list,
                label: dict) -> None:
    """lstat(2) of 1000 random cs9 entries by their path from the mount root,
    so every dentry on the way is looked up: only the dentries and inodes
    dropped (`echo 2 > drop_caches`), the image's pages cached (read back
    for the mounts that read it), timed inside the process (its start and
    the list's reading left out), median of LOOKUP_RUNS, interleaved. The
    same walk through a FUSE server that does no work (NULLFS_C) is what
    FUSE itself costs: the floor of any server, measured in the same run."""
    prog = compile_c(shutil.which("gcc"), work / "lstatn", LSTAT_C)
    if prog is None:
        b.skip("lookup", "lstat of 1000 random entries by path", "gcc not found or failed")
        return
    mnt = dict(mnt)
    label = dict(label, floor="a FUSE server that does no work (libfuse, C, /dev/fuse)")
    floor, why = m.null_fuse("null")
    if why:
        b.note(f"{label['floor']}: not measured: {why}")
    else:
        mnt["floor"] = floor
    sample = random.Random(SEED + 7).sample(paths, min(1000, len(paths)))
    listing = work / "lookup-paths"
    listing.write_text("".join(p + "\n" for p in sample))
    title = "lstat of 1000 random entries by path, dentries dropped (echo 2), image cached"
    series = {k: lib.Series(label[k], [str(prog), str(mnt[k]), str(listing)]) for k in mnt}
    keys = list(mnt)
    for i in range(-1, LOOKUP_RUNS):
        for k in keys[i % len(keys):] + keys[: i % len(keys)] if i >= 0 else keys:
            s = series[k]
            if s.error is not None:
                continue
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("2\n")
            read_file(images.get(k, image))
            smp = lib.run_once(s.argv, timeout=b.timeout, capture_stdout=True)
            if not smp.ok:
                s.error = lib.describe_failure(smp, b.timeout)
                continue
            # The program's own timing replaces the process's wall time.
            smp.wall = int(smp.stdout) / 1e9
            if i >= 0:
                s.samples.append(smp)
            b.progress(f"{title}: {s.tool} run {i + 1}: {smp.wall * 1e3:.1f} ms", final=False)
    for s in series.values():
        if s.error is not None:
            s.samples.clear()
    notes = ["timed inside the process: lstat calls only"]
    rows_for(b, "lookup/1000", title, series, fuse_keys, {"kernel": 1.5, "composefs-fuse": 1.0,
                                                           "composefs-rs": None, "floor": None}, label, cold=True,
             notes=notes)
    # What FUSE costs before any server works: no goal, it is the kernel's.
    rows_for(b, "lookup/1000", title, series, ["floor"], {"kernel": None}, label, cold=True, notes=notes)



def tenfold_dump(src: Path, dest: Path, copies: int = 10) -> int:
    """Writes the dump `src` `copies` times under /d0 .. /d9 of one root (the
    root line once, then every entry of each copy with its path, and a
    hardlink's target, prefixed); returns the number of entries."""
    n = 0
    with open(src, "rb") as f:
        lines = f.read().splitlines()
    if not lines or not lines[0].startswith(b"/ "):
        raise ValueError(f"{src}: the first entry is not the root")
    with open(dest, "wb") as out:
        out.write(lines[0] + b"\n")
        n += 1
        for i in range(copies):
            pre = b"/d%d" % i
            out.write(pre + lines[0][1:] + b"\n")  # the root's metadata for /dN
            n += 1
            for ln in lines[1:]:
                f = ln.split(b" ")
                f[0] = pre + f[0]
                if len(f) > 8 and f[2].startswith(b"@") and f[8].startswith(b"/"):
                    f[8] = pre + f[8]
                out.write(b" ".join(f) + b"\n")
                n += 1
    return n


def tenfold_rows(b, work: Path, m: Mounts) -> None:
    src = b.assets / DUMP
    if not src.is_file():
        b.skip("cs9x10", "ls -lR of cs9 × 10", f"{src} not found (set TILEFS_ASSETS)")
        return
    one = work / "cs9-one.dump"
    with gzip.open(src, "rb") as fin, open(one, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    dump = work / "cs9x10.dump"
    entries = tenfold_dump(one, dump)
    one.unlink()
    image = work / "cs9x10.img"
    r = subprocess.run([b.tilefs, "build", "-q", "--from-dump", dump, image], capture_output=True, text=True)
    if r.returncode != 0:
        b.skip("cs9x10", "ls -lR of cs9 × 10", f"tilefs build failed: {r.stderr.strip()[-300:]}")
        return
    dump.unlink()
    image_size = image.stat().st_size
    store = work / "store-empty-x10"
    store.mkdir()
    images = {}
    for k in ("kernel", "composefs-fuse"):
        images[k] = work / f"cs9x10-{k}.img"
        shutil.copyfile(image, images[k])
    mnt, why, label = {}, {}, dict(LABELS)
    for k, mp, err, lab in m.fuse_transports("fuse", "tilefs FUSE", store, image):
        mnt[k], why[k], label[k] = mp, err, lab
    fuse_keys = [k for k in mnt if not why[k]]
    mnt["kernel"], why["kernel"] = m.kernel("kernel-x10", store, images["kernel"])
    mnt["composefs-fuse"], why["composefs-fuse"] = m.composefs_fuse("cfs-x10", store, images["composefs-fuse"])
    for k in mnt:
        if why[k]:
            b.note(f"cs9 × 10, {label[k]}: not measured: {why[k]}")
    if not fuse_keys:
        b.skip("cs9x10", "ls -lR of cs9 × 10", "no tilefs FUSE mount")
        return
    configs = [k for k in mnt if not why[k]]
    b.note(f"cs9 × 10: the cs9-x86_64-developer dump under /d0 .. /d9 of one root, {entries:,} entries, "
           f"image {image_size / 1e6:.1f} MB; {min(b.runs, 3)} warm runs")
    for cold in ((True, False) if b.can_drop_caches() else (False,)):
        cw = "cold" if cold else "warm"
        title = f"ls -lR cs9 × 10 ({entries:,} entries), {cw} cache"
        s = measure(b, title, {k: ["ls", "-lR", mnt[k]] for k in configs}, cold=cold, labels=label,
                    runs=None if cold else min(b.runs, 3))
        rows_for(b, f"cs9x10/ls-lR/{cw}", title, s, fuse_keys, {"kernel": 1.2, "composefs-fuse": 1.0}, label,
                 cold=cold)
    for k in fuse_keys:
        server_rss(b, f"cs9x10/rss/{k}", "ls -lR of cs9 × 10", mnt[k], label[k], image_size)
    for k in configs:  # 642k inodes: free them for the rows that follow
        subprocess.run([b.tilefs, "umount", mnt[k]] if k != "composefs-fuse" else ["umount", mnt[k]],
                       capture_output=True)


def data_rows(b, work: Path, m: Mounts) -> None:
    gcc = shutil.which("gcc")
    zstd = find_zstd_lib()
    src = work / "data-src"
    src.mkdir()
    big = src / "big"
    b.progress(f"writing a {BIG_MIB} MiB random file ...", final=False)
    with open("/dev/urandom", "rb") as r, open(big, "wb") as f:
        for _ in range(BIG_MIB):
            f.write(r.read(1 << 20))
    if zstd:
        shutil.copytree(zstd, src / "zstd-lib", symlinks=True)
    store = work / "store-data"
    image = work / "data.img"
    b.progress("building the data image (objects copied into the store) ...", final=False)
    r = subprocess.run([b.tilefs, "build", "-q", "--store", store, src, image], capture_output=True, text=True)
    if r.returncode != 0:
        b.skip("data", "data benchmarks", f"tilefs build --store failed: {r.stderr.strip()[-300:]}")
        return
    cfs_image = work / "data-composefs-fuse.img"
    shutil.copyfile(image, cfs_image)
    mnt, why, label = {}, {}, dict(LABELS)
    for key, what, tuning in (("fuse", "tilefs FUSE, passthrough", ""),
                              ("served", "tilefs FUSE, reads served", "no-passthrough")):
        for k, mp, err, lab in m.fuse_transports(f"d{key}", what, store, image, tuning=tuning):
            k = key + k[k.index("/"):]
            mnt[k], why[k], label[k] = mp, err, lab
    passthrough = [k for k in mnt if k.startswith("fuse/") and not why[k]]
    served = [k for k in mnt if k.startswith("served/") and not why[k]]
    mnt["kernel"], why["kernel"] = m.kernel("dkernel", store, image)
    mnt["composefs-fuse"], why["composefs-fuse"] = m.composefs_fuse("dcfs", store, cfs_image)
    mnt["native"], why["native"] = src, ""
    for k in mnt:
        if why[k]:
            b.note(f"data rows, {label[k]}: not measured: {why[k]}")
    ok = [k for k in mnt if not why[k]]
    fuse_keys = passthrough + served
    if not fuse_keys:
        b.skip("data", "data benchmarks", "no tilefs FUSE mount")
        return
    # The first open of each object verifies it: done once here, untimed.
    for k in fuse_keys:
        subprocess.run(["cat", mnt[k] / "big"], stdout=subprocess.DEVNULL)
    nbytes = BIG_MIB << 20
    big_object = next(p for p in store.rglob("*") if p.is_file() and p.stat().st_size == nbytes)

    # Sequential read. Warm, also against an ext4 copy cached in 4 KiB folios:
    # the page cache granularity FUSE has on kernels without large folios for
    # FUSE, so that row shows what the server itself adds.
    small = work / "big-4k"
    shutil.copyfile(big, small)
    folios = compile_c(gcc, work / "folios", FOLIOS_C)
    label["native-4k"] = "ext4 copy cached in 4 KiB folios"
    for cold in ((True, False) if b.can_drop_caches() else (False,)):
        cw = "cold" if cold else "warm"
        title = f"sequential read of a {BIG_MIB} MiB file, {cw} cache"
        argv = {k: ["dd", f"if={mnt[k] / 'big'}", "of=/dev/null", "bs=1M"] for k in ok}
        if not cold:
            read_file(small, small_folios=True)
            argv["native-4k"] = ["dd", f"if={small}", "of=/dev/null", "bs=1M"]
        s = measure(b, title, argv, cold=cold, labels=label)
        notes = []
        if not cold and folios and served:
            paths = {"FUSE": mnt[served[0]] / "big", "native ext4": big, "4 KiB copy": small}
            r = subprocess.run([folios, *map(str, paths.values())], capture_output=True, text=True)
            counts = [line.split() for line in r.stdout.splitlines()]
            if r.returncode == 0 and len(counts) == len(paths):
                notes.append("pages cached in large folios: " + ", ".join(
                    f"{k} {int(c[1]):,} of {int(c[0]):,}" for k, c in zip(paths, counts)))
            else:
                notes.append(f"folio counts not measured: {r.stderr.strip()[-200:]}")
        rows_for(b, f"read/{cw}", title, s, passthrough,
                 {"native": round(1 / 0.95, 3), "kernel": None, "composefs-fuse": 1.0}, label, cold=cold, nbytes=nbytes)
        refs = {"native": 1.25, "composefs-fuse": 1.0}
        if not cold:
            refs["native-4k"] = None
        rows_for(b, f"read/{cw}", title, s, served, refs, label, cold=cold, nbytes=nbytes, notes=notes)

    # access(2).
    prog = compile_c(gcc, work / "access1", ACCESS_C)
    if prog is None:
        b.skip("access", "access(2) throughput", "gcc not found or failed")
    else:
        target = "zstd-lib/common/zstd_internal.h" if zstd else "big"
        for procs in (1, 2):
            title = f"access(2) × {ACCESS_CALLS:,} per process, {procs} process{'es' if procs > 1 else ''}"
            script = " & ".join([f'"$0" {ACCESS_CALLS} "$1"'] * procs) + " & wait"
            argv = {k: ["sh", "-c", script, prog, mnt[k] / target]
                    for k in (*passthrough, "kernel", "composefs-fuse", "native") if k in ok}
            s = measure(b, title, argv, cold=False, labels=label)
            rows_for(b, f"access/{procs}", title, s, passthrough,
                     {"kernel": round(1 / 0.9, 3), "composefs-fuse": 1.0}, label, cold=False,
                     notes=[f"file: {target} (4 path components)"])

    # open(2) + close(2): what every program starting from the image does.
    opener = compile_c(gcc, work / "open1", OPEN_C) if zstd else None
    if opener is None:
        b.skip("open", "open(2) + close(2)", "gcc or the zstd-sys crate's sources not found")
    else:
        files = sorted(str(p.relative_to(src / "zstd-lib")) for p in (src / "zstd-lib").rglob("*")
                       if p.is_file() and not p.is_symlink())
        open_list = work / "open-list"
        open_list.write_text("".join(f + "\n" for f in files))
        title = f"open(2) + close(2) of the zstd sources' {len(files)} files × {OPEN_ROUNDS}"
        argv = {k: [opener, str(OPEN_ROUNDS), mnt[k] / "zstd-lib", open_list]
                for k in (*fuse_keys, "kernel", "composefs-fuse") if k in ok}
        s = measure(b, title, argv, cold=False, labels=label)
        rows_for(b, "open", title, s, passthrough, {"kernel": None, "composefs-fuse": 1.0}, label, cold=False,
                 notes=["passthrough needs the server at every open"])
        rows_for(b, "open", title, s, served, {"kernel": None, "composefs-fuse": 1.0}, label, cold=False,
                 notes=["open answered with ENOSYS: opens stay in the kernel"])

    # A C build.
    build = None
    if gcc and zstd:
        build = work / "build.sh"
        build.write_text(BUILD_SH)
        build.chmod(0o755)
        title = "C build: zstd lib (gcc -O0, 2 jobs), sources in the image"
        argv = {k: [build, mnt[k] / "zstd-lib", work / f"out-{k.replace('/', '-')}"]
                for k in (*fuse_keys, "kernel", "composefs-fuse", "native") if k in ok}
        s = measure(b, title, argv, cold=False, labels=label)
        rows_for(b, "build", title, s, passthrough, {"kernel": 1.1, "native": None, "composefs-fuse": 1.0}, label,
                 cold=False)
        rows_for(b, "build", title, s, served, {"kernel": None, "native": None, "composefs-fuse": 1.0}, label,
                 cold=False)
    else:
        b.skip("build", "C build", "gcc or the zstd-sys crate's sources not found (cargo fetch zstd-sys)")

    # Settings that matter for data, with the default transport (io_uring where available).
    variants = [
        ("no-keep-cache,no-passthrough", "no-passthrough", "without keep_cache", ["read-warm", "build"]),
        ("no-max-pages,no-passthrough", "no-passthrough", "without FUSE_MAX_PAGES (128 KiB requests)", ["read-cold"]),
        ("no-splice,no-passthrough", "no-passthrough", "replies copied, not spliced", ["read-store-cached"]),
        ("no-default-permissions", "", "without default_permissions (server answers access)", ["access"]),
        ("no-negative", "", "without negative entries", ["build"]),
        ("open,no-passthrough", "no-passthrough", "open answered (not ENOSYS)", ["open", "build"]),
        ("flush", "", "flush answered (not ENOSYS)", ["open"]),
        ("--idle-poll=off", "", "idle CPUs left to halt (--idle-poll=off)", ["open", "build"]),
    ]
    for tuning, base_tuning, what, works in variants:
        group = served if base_tuning else passthrough
        if not group:
            continue
        bk = group[0]
        base = mnt[bk]
        tr = label[bk][label[bk].rindex("("):]
        env, flags = variant_args(tuning)
        vm, err = m.fuse(tuning.replace(",", "+"), store, image, tuning=env,
                         extra=[*flags, *([] if bk.endswith("/uring") else ["--no-uring"])])
        if err:
            b.note(f"{tuning}: not measured: {err}")
            continue
        subprocess.run(["cat", vm / "big"], stdout=subprocess.DEVNULL)
        for w in works:
            after_drop, runs = None, 3
            if w.startswith("read"):
                cold = w != "read-warm"
                if cold and not b.can_drop_caches():
                    continue
                argv_of = lambda p: ["dd", f"if={p / 'big'}", "of=/dev/null", "bs=1M"]  # noqa: E731
                name = f"{BIG_MIB} MiB read, {'cold' if cold else 'warm'}"
                if w == "read-store-cached":
                    # What a mount right after `tilefs build --store` sees.
                    name = f"{BIG_MIB} MiB read, FUSE cache cold, store cached"
                    after_drop, runs = (lambda _k: read_file(big_object)), 7
            elif w == "access":
                if prog is None:
                    continue
                cold = False
                # Every call is a round trip without default_permissions: fewer calls.
                argv_of = lambda p: [prog, str(ACCESS_CALLS // 20), p / "big"]  # noqa: E731
                name = f"access(2) × {ACCESS_CALLS // 20:,}, 1 process"
            elif w == "open":
                if opener is None:
                    continue
                cold = False
                argv_of = lambda p: [opener, str(OPEN_ROUNDS), p / "zstd-lib", open_list]  # noqa: E731
                name = f"open(2) + close(2) × {len(files) * OPEN_ROUNDS:,}"
            else:
                if build is None:
                    continue
                cold = False
                argv_of = lambda p: [build, p / "zstd-lib", work / f"out-{p.name}"]  # noqa: E731
                name = "C build"
            s = measure(b, f"{name}: {what}", {"default": argv_of(base), tuning: argv_of(vm)}, cold=cold, runs=runs,
                        after_drop=after_drop)
            row(b, f"setting/{tuning}/{w}", f"setting: {what} vs default {tr} — {name}", s[tuning], s["default"],
                "FUSE default" + (" (no passthrough)" if base_tuning else "") + f" {tr}", cold=cold)
        subprocess.run([b.tilefs, "umount", vm], capture_output=True)
    if b.can_drop_caches():
        b.note("cold: sync; echo 3 > /proc/sys/vm/drop_caches before every run (the FUSE server keeps its "
               "in-memory tree and its record of verified objects)")


def variant_args(setting: str) -> tuple[str, list[str]]:
    """A setting row's (TILEFS_FUSE_TUNING, command-line flags): a setting
    starting with -- is a flag of `tilefs mount`, any other a tuning."""
    return ("", [setting]) if setting.startswith("--") else (setting, [])


def compile_c(gcc: str | None, exe: Path, source: str, flags=()) -> Path | None:
    """`exe` built from C `source` with gcc -O2 (then `flags`), or None without gcc or on failure."""
    if not gcc:
        return None
    c = exe.with_suffix(".c")
    c.write_text(source)
    ok = subprocess.run([gcc, "-O2", "-o", exe, c, *flags], capture_output=True).returncode == 0
    return exe if ok else None


def find_zstd_lib() -> Path | None:
    """zstd's lib directory from the zstd-sys crate in cargo's registry."""
    home = Path(os.environ.get("CARGO_HOME") or Path.home() / ".cargo")
    found = sorted(home.glob("registry/src/*/zstd-sys-*/zstd/lib"))
    return found[-1] if found else None
