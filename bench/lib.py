"""Shared machinery of the tilefs benchmarks (Python 3.11 standard library only).

A section (bench/sections/NAME.py) receives a `Bench` and calls
`bench.compare(...)` for each tilefs-versus-reference measurement,
`bench.info(...)` for a single reference figure and `bench.skip(...)` for a
row it cannot measure here. `bench/run` collects the rows and writes the
results; see bench/README.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import filecmp
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent


class Interrupted(Exception):
    """Raised on SIGTERM/SIGHUP (SIGINT raises KeyboardInterrupt)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    log(f"bench: warning: {msg}")


def env_int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        warn(f"{name}={raw!r} is not an integer; using {default}")
        return default
    if value < minimum:
        warn(f"{name}={value} is below {minimum}; using {minimum}")
        return minimum
    return value


# ---------------------------------------------------------------------------
# Running one command: wall time, CPU time and peak RSS of exactly that child.
# ---------------------------------------------------------------------------

_current_child: subprocess.Popen | None = None
_gnu_time: str | None | bool = False  # False: not probed yet


def gnu_time() -> str | None:
    """Path of GNU time if installed (its %M is the peak RSS of the command alone)."""
    global _gnu_time
    if _gnu_time is False:
        _gnu_time = None
        for cand in ("/usr/bin/time", shutil.which("gnutime"), shutil.which("gtime")):
            if cand and os.access(cand, os.X_OK):
                v = subprocess.run([cand, "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if "GNU" in v.stdout + v.stderr:
                    _gnu_time = cand
                    break
    return _gnu_time


def rss_method() -> str:
    if gnu_time():
        return f"GNU time %M ({gnu_time()})"
    return "wait4 rusage of the child (GNU time not installed: floor is the harness's own RSS)"


@dataclasses.dataclass
class Sample:
    wall: float  # seconds
    user: float  # seconds of user CPU
    sys: float  # seconds of system CPU
    maxrss_kib: int  # peak resident set size of the command
    rc: int
    timed_out: bool = False
    stderr_tail: str = ""
    stdout: bytes = b""

    @property
    def cpu(self) -> float:
        return self.user + self.sys

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out


def kill_current_child() -> None:
    p = _current_child
    if p is not None and p.returncode is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the command and, under GNU time, its child
        except OSError:
            pass


def run_once(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    capture_stdout: bool = False,
    cwd: str | os.PathLike | None = None,
) -> Sample:
    """Runs argv once: wall time by perf_counter, CPU time by wait4, peak RSS.

    Peak RSS comes from GNU time's %M when installed. A child forked from this
    Python process would otherwise inherit Python's own RSS as its max-RSS
    floor (Linux carries the pre-exec high-water mark across exec); GNU time is
    small (~1 MiB). Without it, the child's wait4 rusage is used as is.
    The command runs in its own process group so a timeout or Ctrl-C kills all of it.
    """
    global _current_child
    argv = [str(a) for a in argv]
    gt = gnu_time()
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out, \
            tempfile.NamedTemporaryFile(prefix="tilefs-bench-rss-") as rssf:
        full = [gt, "-f", "%M", "-o", rssf.name, "--", *argv] if gt else argv
        if gt and not shutil.which(argv[0]):
            return Sample(0.0, 0.0, 0.0, 0, 127, stderr_tail=f"cannot run {argv[0]}: not found or not executable")
        t0 = time.perf_counter()
        try:
            p = subprocess.Popen(
                full,
                stdin=subprocess.DEVNULL,
                stdout=out if capture_stdout else subprocess.DEVNULL,
                stderr=err,
                cwd=cwd,
                process_group=0,
            )
        except OSError as e:
            return Sample(0.0, 0.0, 0.0, 0, 127, stderr_tail=f"cannot run {argv[0]}: {e}")
        _current_child = p
        fired = threading.Event()

        def on_timeout() -> None:
            fired.set()
            kill_current_child()

        timer = threading.Timer(timeout, on_timeout) if timeout else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
            wall = time.perf_counter() - t0
            p.returncode = os.waitstatus_to_exitcode(status)
        except BaseException:
            # Ctrl-C or SIGTERM while the command runs: never leave it behind.
            kill_current_child()
            try:
                p.wait(timeout=10)
            except Exception:
                pass
            raise
        finally:
            if timer:
                timer.cancel()
            _current_child = None
        maxrss = ru.ru_maxrss
        if gt:
            lines = Path(rssf.name).read_text(errors="replace").split()
            maxrss = int(lines[-1]) if lines and lines[-1].isdigit() else 0
        err.seek(0)
        tail = err.read()[-4000:].decode("utf-8", "replace").strip()
        stdout = b""
        if capture_stdout:
            out.seek(0)
            stdout = out.read(1 << 20)
    return Sample(
        wall=wall,
        user=ru.ru_utime,
        sys=ru.ru_stime,
        maxrss_kib=maxrss,
        rc=p.returncode,
        timed_out=fired.is_set(),
        stderr_tail=tail,
        stdout=stdout,
    )


def describe_failure(s: Sample, timeout: float | None) -> str:
    if s.timed_out:
        return f"timed out after {timeout:g} s"
    if s.rc < 0:
        what = f"killed by signal {-s.rc}"
    else:
        what = f"exit {s.rc}"
    lines = [ln for ln in s.stderr_tail.splitlines() if ln.strip()]
    return f"{what}: {lines[-1]}" if lines else what


# ---------------------------------------------------------------------------
# Series of runs and result rows.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Series:
    """Repeated runs of one tool in one benchmark."""

    tool: str
    argv: list[str]
    samples: list[Sample] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples)

    def median(self) -> float:
        return statistics.median(s.wall for s in self.samples)

    def spread(self) -> float:
        """Half the min..max range, relative to the median (0.03 = +-3%)."""
        walls = [s.wall for s in self.samples]
        m = statistics.median(walls)
        return (max(walls) - min(walls)) / 2 / m if m > 0 else 0.0

    def cpu_median(self) -> float:
        return statistics.median(s.cpu for s in self.samples)

    def maxrss_kib(self) -> int:
        return max(s.maxrss_kib for s in self.samples)

    def to_json(self, nbytes: int | None) -> dict:
        d: dict = {"tool": self.tool, "argv": self.argv, "ok": self.ok, "error": self.error}
        if self.samples:
            d.update(
                runs=len(self.samples),
                wall_s=[round(s.wall, 6) for s in self.samples],
                cpu_s=[round(s.cpu, 6) for s in self.samples],
                maxrss_kib=[s.maxrss_kib for s in self.samples],
            )
        if self.ok:
            d.update(
                median_s=round(self.median(), 6),
                spread=round(self.spread(), 4),
                cpu_median_s=round(self.cpu_median(), 6),
                peak_rss_kib=self.maxrss_kib(),
            )
            if nbytes:
                d["mb_per_s"] = round(nbytes / self.median() / 1e6, 1)
        return d


@dataclasses.dataclass
class Row:
    section: str
    id: str
    title: str
    kind: str = "compare"  # compare | info | skip
    tilefs: Series | None = None
    ref: Series | None = None
    ref_tool: str | None = None
    goal: float | None = None  # wanted: ratio <= goal
    rss_goal: float | None = None  # wanted: tilefs peak RSS <= rss_goal x the reference's
    nbytes: int | None = None  # set for throughput rows
    identical: bool | None = None
    value: str | None = None  # info rows: the figure, already formatted
    value_json: dict | None = None
    cold: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)

    def ratio(self) -> float | None:
        if self.tilefs and self.ref and self.tilefs.ok and self.ref.ok and self.ref.median() > 0:
            return self.tilefs.median() / self.ref.median()
        return None

    def goal_met(self) -> bool | None:
        r = self.ratio()
        if self.goal is None or r is None:
            return None
        return r <= self.goal

    def rss_ratio(self) -> float | None:
        if self.tilefs and self.ref and self.tilefs.ok and self.ref.ok and self.ref.maxrss_kib() > 0:
            return self.tilefs.maxrss_kib() / self.ref.maxrss_kib()
        return None

    def rss_goal_met(self) -> bool | None:
        r = self.rss_ratio()
        if self.rss_goal is None or r is None:
            return None
        return r <= self.rss_goal

    def to_json(self) -> dict:
        r = self.ratio()
        return {
            "section": self.section,
            "id": self.id,
            "title": self.title,
            "kind": self.kind,
            "cold_cache": self.cold,
            "bytes": self.nbytes,
            "tilefs": self.tilefs.to_json(self.nbytes) if self.tilefs else None,
            "reference": self.ref.to_json(self.nbytes) if self.ref else None,
            "reference_tool": self.ref_tool,
            "ratio": round(r, 4) if r is not None else None,
            "goal_ratio_max": self.goal,
            "goal_met": self.goal_met(),
            "rss_ratio": round(self.rss_ratio(), 4) if self.rss_ratio() is not None else None,
            "rss_goal_ratio_max": self.rss_goal,
            "rss_goal_met": self.rss_goal_met(),
            "outputs_identical": self.identical,
            "value": self.value_json,
            "notes": self.notes,
        }


# ---------------------------------------------------------------------------
# The context handed to sections.
# ---------------------------------------------------------------------------


class Bench:
    def __init__(self, *, tools: dict, facts: dict, tmp: Path, runs: int, cold_runs: int, timeout: float):
        self.tools = tools  # name -> path or None: tilefs, mkcomposefs, composefs-info, ...
        self.facts = facts
        self.tmp = tmp
        self.runs = runs
        self.cold_runs = cold_runs
        self.timeout = timeout
        self.rows: list[Row] = []
        self.section_notes: dict[str, list[str]] = {}
        self.section_status: dict[str, str] = {}
        self.section = ""
        self.started = time.monotonic()
        self._tty = sys.stderr.isatty()
        self._drop_caches: bool | None = None
        # tool -> a note every row against it carries (how it was built, when
        # that could not be verified or it is unoptimized and allowed).
        self.ref_notes: dict[str, str] = {}
        # Unoptimized references used anyway (BENCH_ALLOW_UNOPTIMIZED).
        self.unoptimized: set[str] = set()

    # -- paths and tools ---------------------------------------------------

    @property
    def tilefs(self) -> str:
        return self.tools["tilefs"]

    def tool(self, name: str) -> str | None:
        return self.tools.get(name)

    def tmpdir(self, name: str) -> Path:
        d = self.tmp / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def assets(self) -> Path:
        return Path(os.environ.get("TILEFS_ASSETS") or REPO.parent / "shared" / "composefs-assets")

    def note(self, text: str) -> None:
        self.section_notes.setdefault(self.section, []).append(text)

    # -- progress ------------------------------------------------------------

    def progress(self, msg: str, final: bool = True) -> None:
        el = int(time.monotonic() - self.started)
        line = f"[{el // 60:02d}:{el % 60:02d}] {self.section}: {msg}"
        if self._tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stderr.write("\r\x1b[K" + line[:width] + ("\n" if final else ""))
            sys.stderr.flush()
        elif final:
            log(line)

    # -- cache control -------------------------------------------------------

    def can_drop_caches(self) -> bool:
        if self._drop_caches is None:
            try:
                self.drop_caches()
                self._drop_caches = True
            except OSError:
                self._drop_caches = False
        return self._drop_caches

    @staticmethod
    def drop_caches() -> None:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    # -- rows ------------------------------------------------------------------

    def skip(self, id: str, title: str, reason: str) -> Row:
        row = Row(self.section, id, title, kind="skip", notes=[reason])
        self.rows.append(row)
        self.progress(f"{title}: skipped ({reason})")
        return row

    def info(self, id: str, title: str, value: str, value_json: dict | None = None, notes: Sequence[str] = ()) -> Row:
        row = Row(self.section, id, title, kind="info", value=value, value_json=value_json, notes=list(notes))
        self.rows.append(row)
        self.progress(f"{title}: {value}")
        return row

    def compare(
        self,
        id: str,
        title: str,
        tilefs_argv: Sequence,
        ref_argv: Sequence | None,
        *,
        ref_tool: str,
        ref_missing: str | None = None,
        outputs: tuple[Path, Path] | None = None,
        same_stdout: Callable[[bytes, bytes], bool] | None = None,
        runs: int | None = None,
        warmup: int = 1,
        cold: bool = False,
        goal: float | None = None,
        rss_goal: float | None = None,
        nbytes: int | None = None,
        prepare: Callable[[str], None] | None = None,
        notes: Sequence[str] = (),
    ) -> Row:
        """Measures tilefs_argv against ref_argv, interleaving their runs.

        outputs: (tilefs output, reference output) files, removed before each
        run and compared byte for byte after the last. same_stdout compares the
        two tools' standard output instead. cold: sync and drop the page cache
        before every timed run (root only). prepare(tool) runs untimed before
        every run of tool ("tilefs" or "reference"). goal: the wanted time
        ratio; rss_goal: the wanted ratio of peak RSS.
        """
        runs = runs or (self.cold_runs if cold else self.runs)
        if cold:
            warmup = 0
        row = Row(self.section, id, title, ref_tool=ref_tool, goal=goal, rss_goal=rss_goal, nbytes=nbytes, cold=cold,
                  notes=list(notes))
        build_note = self.ref_notes.get(ref_tool)
        if ref_argv is not None and build_note:
            row.notes.append(build_note)
        if ref_argv is not None and ref_tool in self.unoptimized:
            # Allowed by BENCH_ALLOW_UNOPTIMIZED, but no goal is judged on it.
            row.goal = row.rss_goal = None
        self.rows.append(row)
        series = [Series("tilefs", [str(a) for a in tilefs_argv])]
        row.tilefs = series[0]
        if ref_argv is not None:
            row.ref = Series(ref_tool, [str(a) for a in ref_argv])
            series.append(row.ref)
        else:
            row.notes.append(ref_missing or f"reference {ref_tool} not found: tilefs alone")
        out_of = {"tilefs": outputs[0], "reference": outputs[1]} if outputs else {}
        last_stdout: dict[str, bytes] = {}

        def one(s: Series, label: str) -> None:
            role = "tilefs" if s is row.tilefs else "reference"
            if role in out_of:
                out_of[role].unlink(missing_ok=True)
            if prepare:
                prepare(role)
            if cold:
                self.drop_caches()
            self.progress(f"{title}: {s.tool} {label} ...", final=False)
            smp = run_once(s.argv, timeout=self.timeout, capture_stdout=same_stdout is not None)
            if not smp.ok:
                s.error = describe_failure(smp, self.timeout)
                self.progress(f"{title}: {s.tool} {label} FAILED ({s.error})")
                return
            last_stdout[role] = smp.stdout
            if label.startswith("run"):
                s.samples.append(smp)
            self.progress(f"{title}: {s.tool} {label}: {fmt_time(smp.wall)}, {fmt_rss(smp.maxrss_kib)}", final=not self._tty)

        for w in range(warmup):
            for s in series:
                if s.error is None:
                    one(s, f"warm-up {w + 1}/{warmup}")
        for i in range(runs):
            # Alternate the order so drift and after-effects hit both tools.
            order = series if i % 2 == 0 else list(reversed(series))
            for s in order:
                if s.error is None:
                    one(s, f"run {i + 1}/{runs}")
        # A series that failed midway has no trustworthy median.
        for s in series:
            if s.error is not None:
                s.samples.clear()

        if row.tilefs.ok and row.ref is not None and row.ref.ok:
            if outputs:
                a, b = outputs
                if a.exists() and b.exists():
                    row.identical = filecmp.cmp(a, b, shallow=False)
                    if not row.identical:
                        row.notes.append(
                            f"OUTPUTS DIFFER: tilefs {a.stat().st_size} bytes, {ref_tool} {b.stat().st_size} bytes"
                        )
            elif same_stdout is not None:
                row.identical = same_stdout(last_stdout.get("tilefs", b""), last_stdout.get("reference", b""))
                if not row.identical:
                    row.notes.append("OUTPUTS DIFFER")
        self.progress(summary_line(row))
        return row


    def interleave(self, title: str, series: dict, *, cold: bool, runs: int | None = None,
                   after_drop: Callable[[str], None] | None = None,
                   prepare: Callable[[str], None] | None = None) -> dict:
        """Runs each Series of `series` (by key) `runs` times, rotating the
        order every round; warm runs get one untimed warm-up each, cold runs
        drop the caches first and then call after_drop(key). prepare(key)
        runs untimed before every run of key (warm-up included). A series
        that fails keeps its error and no samples."""
        runs = runs or (self.cold_runs if cold else self.runs)
        keys = list(series)

        def one(k: str, label: str, keep: bool) -> None:
            s = series[k]
            if s.error is not None:
                return
            if prepare:
                prepare(k)
                if s.error is not None:  # prepare may fail the series
                    return
            if cold:
                self.drop_caches()
                if after_drop:
                    after_drop(k)
            self.progress(f"{title}: {s.tool} {label} ...", final=False)
            smp = run_once(s.argv, timeout=self.timeout)
            if not smp.ok:
                s.error = describe_failure(smp, self.timeout)
                self.progress(f"{title}: {s.tool} FAILED ({s.error})")
                return
            if keep:
                s.samples.append(smp)

        if not cold:
            for k in keys:
                one(k, "warm-up", keep=False)
        for i in range(runs):
            for k in keys[i % len(keys):] + keys[: i % len(keys)]:
                one(k, f"run {i + 1}/{runs}", keep=True)
        for s in series.values():
            if s.error is not None:
                s.samples.clear()
        return series


def is_mountpoint(p: Path) -> bool:
    target = str(p).replace(" ", "\\040")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        if len(f) > 4 and f[4] == target:
            return True
    return False


# ---------------------------------------------------------------------------
# FUSE servers: the io_uring switch, the server of a mount, its transport.
# ---------------------------------------------------------------------------

URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")


class FuseUring:
    """`with FuseUring() as u:` turns FUSE over io_uring on (the fuse module's
    enable_uring parameter, root only) for the block and puts the old value
    back when it ends, also on failure, Ctrl-C or SIGTERM (bench/run raises
    them as exceptions). Unmount every io_uring mount before the block ends:
    with the parameter off, the kernel refuses the server's next ring
    command. `u.available` is False, and nothing is changed, where the kernel
    has no such parameter or it cannot be set; `u.why` then says why."""

    def __init__(self) -> None:
        self.old: str | None = None
        self.changed = False
        self.available = False
        self.why = ""

    def __enter__(self) -> "FuseUring":
        try:
            self.old = URING_PARAM.read_text().strip()
        except OSError:
            self.why = f"this kernel has no FUSE over io_uring (no {URING_PARAM})"
            return self
        if self.old == "Y":
            self.available = True
            return self
        try:
            URING_PARAM.write_text("Y\n")
            self.changed = self.available = True
        except OSError as e:
            self.why = f"cannot turn FUSE over io_uring on ({URING_PARAM}: {e.strerror})"
        return self

    def restore(self) -> None:
        if self.changed and self.old is not None:
            try:
                URING_PARAM.write_text(self.old + "\n")
                self.changed = False
            except OSError as e:
                warn(f"cannot put {URING_PARAM} back to {self.old}: {e}")

    def __exit__(self, *exc) -> None:
        self.restore()

    def describe(self) -> str:
        if not self.available:
            return self.why
        was = f"was {self.old}, set to Y for this section and put back after" if self.changed else "was already Y"
        return f"{URING_PARAM}: {was}"


def fuse_server_pid(mnt: Path) -> int | None:
    """The process serving a `tilefs mount --fuse ... MNT` (found by its command line)."""
    want = str(mnt).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"mount") for a in args) and want in args:
            return int(d.name)
    return None


def fuse_transport(pid: int | None) -> str | None:
    """How a tilefs FUSE server gets its requests, from its threads' names:
    "io_uring" when it has queue threads (fuse-q0, fuse-q1, ...), else
    "/dev/fuse"; None without a server."""
    if pid is None:
        return None
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for t in tasks:
        try:
            if (t / "comm").read_text().startswith("fuse-q"):
                return "io_uring"
        except OSError:
            continue
    return "/dev/fuse"


def fuse_idle_poll(pid: int | None) -> str:
    """Whether a tilefs FUSE server keeps idle CPUs polling while it serves
    (`--idle-poll`): it then holds /dev/cpu_dma_latency open."""
    if pid is None:
        return "unknown (server not found)"
    try:
        held = any(os.readlink(f) == "/dev/cpu_dma_latency" for f in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return "unknown (cannot read the server's descriptors)"
    if held:
        return ("on: the server holds a 0 µs CPU latency request (/dev/cpu_dma_latency) while requests flow, "
                "relaxed 1 ms after the last, so idle CPUs poll instead of halting (--idle-poll auto: "
                "a VM without guest halt polling); the reference servers hold none")
    return "off (--idle-poll auto: not a VM without guest halt polling, or not root)"


def proc_status_kib(pid: int, field: str) -> int | None:
    """A kB field of /proc/PID/status (VmHWM, VmRSS), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------
# Formatting.
# ---------------------------------------------------------------------------


def fmt_time(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.1f} ms" if s < 0.1 else f"{s * 1000:.0f} ms"
    return f"{s:.2f} s"


def fmt_rss(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def fmt_series(s: Series | None, nbytes: int | None) -> str:
    if s is None:
        return "—"
    if not s.ok:
        return "**FAILED**" if s.error else "—"
    t = f"{fmt_time(s.median())} ±{s.spread() * 100:.0f}%"
    if nbytes:
        return f"{nbytes / s.median() / 1e6:,.0f} MB/s ({t})"
    return t


def summary_line(row: Row) -> str:
    parts = [f"{row.title}: tilefs {fmt_series(row.tilefs, row.nbytes)}"]
    if row.ref is not None:
        parts.append(f"{row.ref_tool} {fmt_series(row.ref, row.nbytes)}")
    r = row.ratio()
    if r is not None:
        parts.append(f"ratio {r:.2f}")
    if row.identical is False:
        parts.append("OUTPUTS DIFFER")
    return ", ".join(parts)


def md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(bench: Bench, meta: dict, sections: list) -> str:
    f = bench.facts
    out = ["# tilefs benchmark results", ""]
    status = meta.get("status", "complete")
    if status != "complete":
        out += [f"**Run {status}: partial results.**", ""]
    out += ["| machine | |", "|---|---|"]
    for key, label in FACT_LABELS:
        if f.get(key) not in (None, ""):
            out.append(f"| {label} | {md_escape(str(f[key]))} |")
    out.append(
        f"| runs | median of {bench.runs} warm runs (BENCH_RUNS), {bench.cold_runs} cold runs (BENCH_COLD_RUNS); "
        f"one untimed warm-up per tool before warm runs |"
    )
    out.append("")

    warnings = collect_warnings(bench.rows)
    goals = [r for r in bench.rows if r.goal is not None and r.kind == "compare"]
    rss_goals = [r for r in bench.rows if r.rss_goal is not None and r.kind == "compare"]
    if goals or rss_goals or warnings:
        met = sum(1 for r in goals if r.goal_met())
        unmeasured = sum(1 for r in goals if r.goal_met() is None)
        if goals:
            out.append(
                f"**Goals met: {met}/{len(goals)}**"
                + (f" ({unmeasured} not measured: a tool failed or is missing)" if unmeasured else "")
                + " (ratio = tilefs time / reference time, lower is better)."
            )
            out.append("")
        if rss_goals:
            rmet = sum(1 for r in rss_goals if r.rss_goal_met())
            runm = sum(1 for r in rss_goals if r.rss_goal_met() is None)
            out.append(
                f"**Peak RSS goals met: {rmet}/{len(rss_goals)}**"
                + (f" ({runm} not measured)" if runm else "")
                + " (tilefs peak RSS / reference peak RSS)."
            )
            out.append("")
        for w in warnings:
            out.append(f"- ⚠ **{md_escape(w)}**")
        if warnings:
            out.append("")

    for mod in sections:
        name = mod.NAME
        rows = [r for r in bench.rows if r.section == name]
        out += [f"## {name}: {mod.TITLE}", ""]
        st = bench.section_status.get(name)
        if st and st != "ok":
            out += [f"**Section {st}.**", ""]
        if rows:
            out.append("| benchmark | tilefs | reference | ratio | goal | peak RSS tilefs / ref | tilefs cores | output | notes |")
            out.append("|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                out.append(render_row(r))
            out.append("")
        for n in bench.section_notes.get(name, []):
            out.append(f"- {md_escape(n)}")
        cmds = [r for r in rows if r.kind == "compare"]
        if cmds:
            out += ["", "<details><summary>commands</summary>", ""]
            for r in cmds:
                out.append(f"- {md_escape(r.title)}")
                for s in (r.tilefs, r.ref):
                    if s is not None:
                        out.append(f"  - `{shell_join(shorten_paths(elide(s.argv), bench.tmp))}`")
            out += ["", "</details>"]
        out.append("")
    out += [
        "Times are medians (± is half the min–max range relative to the median); ratio is tilefs "
        "median / reference median measured in this same run; peak RSS is the largest max-RSS over the "
        "runs; tilefs cores is CPU time / wall time. See bench/README.md.",
        "",
    ]
    return "\n".join(out)


def render_row(r: Row) -> str:
    ratio = r.ratio()
    if r.kind == "skip":
        cells = [r.title, "skipped", "—", "—", "—", "—", "—", "—", "; ".join(r.notes)]
    elif r.kind == "info":
        cells = [r.title, "—", r.value or "—", "—", "—", "—", "—", "—", "; ".join(r.notes)]
    else:
        goal = "—"
        if r.goal is not None:
            met = r.goal_met()
            goal = f"≤ {r.goal:g}" + (" (not measured)" if met is None else (" ✓ met" if met else " ✗ **missed**"))
        if r.rss_goal is not None:
            met = r.rss_goal_met()
            g = f"RSS ≤ {r.rss_goal:g}" + (" (not measured)" if met is None else (" ✓" if met else " ✗ **missed**"))
            goal = g if goal == "—" else f"{goal}; {g}"
        rss = "—"
        if r.tilefs and r.tilefs.ok:
            rss = fmt_rss(r.tilefs.maxrss_kib())
            if r.ref is not None:
                rss += " / " + (fmt_rss(r.ref.maxrss_kib()) if r.ref.ok else "—")
            if r.rss_ratio() is not None:
                rss += f" ({r.rss_ratio():.2f})"
        cores = f"{r.tilefs.cpu_median() / r.tilefs.median():.2f}" if r.tilefs and r.tilefs.ok and r.tilefs.median() > 0 else "—"
        ident = {True: "identical", False: "**MISMATCH**", None: "—"}[r.identical]
        notes = list(r.notes)
        for s in (r.tilefs, r.ref):
            if s is not None and s.error:
                notes.insert(0, f"{s.tool} failed: {s.error}")
        cells = [
            r.title,
            fmt_series(r.tilefs, r.nbytes),
            fmt_series(r.ref, r.nbytes) + (f" ({r.ref_tool})" if r.ref is not None and r.ref.ok else ""),
            f"**{ratio:.2f}**" if ratio is not None else "—",
            goal,
            rss,
            cores,
            ident,
            "; ".join(notes),
        ]
    return "| " + " | ".join(md_escape(c) for c in cells) + " |"


def collect_warnings(rows: list[Row]) -> list[str]:
    w = []
    for r in rows:
        if r.identical is False:
            w.append(f"{r.section}/{r.id}: tilefs and {r.ref_tool} outputs DIFFER")
        for s in (r.tilefs, r.ref):
            if s is not None and s.error:
                w.append(f"{r.section}/{r.id}: {s.tool} FAILED ({s.error})")
    return w


def elide(argv: list[str], keep: int = 4) -> list[str]:
    """Long argument lists (stat of 1,000 paths) shortened for the table; the JSON keeps them whole."""
    if len(argv) <= 3 * keep:
        return argv
    return argv[:keep] + [f"... ({len(argv) - keep} more arguments)"]


def shorten_paths(argv: list[str], tmp: Path) -> list[str]:
    t = str(tmp)
    return [a.replace(t, "$TMP") for a in argv]


def shell_join(argv: list[str]) -> str:
    import shlex

    return " ".join(a if a.startswith("$TMP") and " " not in a else shlex.quote(a) for a in argv)


# ---------------------------------------------------------------------------
# How the reference tools were built: only optimized builds are compared.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class BuildInfo:
    """What could be learnt of how a binary was compiled."""

    optimized: bool | None  # None: could not tell
    how: str  # one line for the results


# Share of instructions addressing memory relative to %rbp: gcc -O0 keeps
# every local variable there (about a third of all instructions in
# composefs, a plain `meson setup` or `-Dbuildtype=debug` build), optimized
# code keeps them in registers (about 1%, frame pointer or not).
O0_RBP_SHARE = 0.15


def elf_sections(path: str) -> set[str]:
    """Section names of an ELF file (readelf), empty if it cannot be read."""
    out = capture(["readelf", "-S", "-W", path]) or ""
    return set(re.findall(r"\]\s+(\.\S+)", out))


def gcc_opt_flags(path: str) -> list[str]:
    """-O flags of the compilation units, from DWARF producer strings (needs -g)."""
    out = capture(["readelf", "--debug-dump=info", "--dwarf-depth=1", path]) or ""
    flags = set()
    for m in re.finditer(r"DW_AT_producer\s*:.*?:\s*(.*)", out):
        flags.update(re.findall(r"(?<!\S)-O\S*", m.group(1)))
    return sorted(flags)


def rbp_share(path: str) -> float | None:
    out = capture(["objdump", "-d", "--no-show-raw-insn", path])
    if not out:
        return None
    insns = [ln for ln in out.splitlines() if re.match(r"\s+[0-9a-f]+:\t", ln)]
    if len(insns) < 100:
        return None
    return sum(1 for ln in insns if "(%rbp)" in ln) / len(insns)


def meson_build_dir(binary: Path) -> Path | None:
    """$COMPOSEFS_BUILDDIR, or the meson build directory the binary lives in."""
    env = os.environ.get("COMPOSEFS_BUILDDIR")
    if env:
        return Path(env)
    for d in list(binary.parents)[:4]:
        if (d / "meson-info" / "intro-buildoptions.json").is_file():
            return d
    return None


def c_build_info(binary: str) -> BuildInfo:
    """Build type of a C tool and the libcomposefs it loads: meson's options when
    its build directory is known, else the code itself (DWARF producer flags
    with -g; without, how much of it addresses locals through %rbp)."""
    real = Path(binary).resolve()
    files = [str(real)]
    for ln in (capture(["ldd", str(real)]) or "").splitlines():
        m = re.match(r"\s*(libcomposefs\S*) => (\S+)", ln)
        if m:
            files.append(str(Path(m.group(2)).resolve()))
    parts: list[str] = []
    verdicts: list[bool | None] = []
    bdir = meson_build_dir(real)
    if bdir is not None:
        try:
            opts = {o["name"]: o["value"] for o in json.loads((bdir / "meson-info" / "intro-buildoptions.json").read_text())}
            opt = str(opts.get("optimization"))
            parts.append(f"meson buildtype={opts.get('buildtype')} (optimization={opt}, debug={opts.get('debug')}) in {bdir}")
            built = bdir / "tools" / real.name
            if built.is_file() and not filecmp.cmp(built, real, shallow=False):
                parts.append(f"but {real} differs from {built}")
            elif opt != "plain":
                # (plain: the flags came from the environment; the code says.)
                verdicts.append(opt not in ("0", "g"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            parts.append(f"meson options unreadable in {bdir}: {e}")
    for f in files:
        name = Path(f).name
        secs = elf_sections(f)
        if ".debug_info" in secs:
            flags = gcc_opt_flags(f)
            if flags:
                parts.append(f"{name}: compiled with {' '.join(flags)}")
                verdicts.append(not any(x in ("-O0", "-Og") for x in flags) and any(x != "-O0" for x in flags))
                continue
        share = rbp_share(f)
        if share is None:
            parts.append(f"{name}: code not inspected (no objdump, or too little code)")
            verdicts.append(None)
        else:
            opt = share < O0_RBP_SHARE
            parts.append(f"{name}: {'optimized' if opt else 'UNOPTIMIZED (-O0)'} ({share:.1%} of instructions address %rbp, -O0 ~30%)")
            verdicts.append(opt)
    optimized = False if False in verdicts else (True if verdicts and all(verdicts) else None)
    return BuildInfo(optimized, "; ".join(parts))


def rust_build_info(binary: str) -> BuildInfo:
    """Cargo profile of a Rust tool: from its place in a target directory (or an
    identical copy there), and whether overflow checks (the dev profile) are
    compiled in."""
    real = Path(binary).resolve()
    parts: list[str] = []
    profile = None
    if real.parent.name in ("release", "debug") and real.parent.parent.name == "target":
        profile = real.parent.name
        parts.append(f"cargo {profile} profile ({real})")
    else:
        for cand in (real.parent.parent / "target" / p / real.name for p in ("release", "debug")):
            if cand.is_file() and cand.stat().st_size == real.stat().st_size and filecmp.cmp(cand, real, shallow=False):
                profile = cand.parent.name
                parts.append(f"cargo {profile} profile (same bytes as {cand})")
                break
    try:
        overflow_checks = b"attempt to add with overflow" in real.read_bytes()
    except OSError:
        overflow_checks = None
    if overflow_checks:
        parts.append("overflow checks compiled in (the dev profile's)")
    elif overflow_checks is False:
        parts.append("no overflow checks (as cargo's release profile)")
    if profile == "debug" or overflow_checks:
        optimized: bool | None = False
    elif profile == "release":
        optimized = True
    else:
        optimized = None
    ver = capture([str(real), "--version"])
    if ver:
        parts.insert(0, ver.splitlines()[0])
    return BuildInfo(optimized, "; ".join(parts) or "unknown")


def allow_unoptimized() -> bool:
    return os.environ.get("BENCH_ALLOW_UNOPTIMIZED", "") not in ("", "0")


# ---------------------------------------------------------------------------
# Inputs several sections use, made once per run.
# ---------------------------------------------------------------------------


def shared_dir(b: "Bench") -> Path:
    """A directory under the run's temporary directory that lives for the whole run."""
    d = b.tmp / "_shared"
    d.mkdir(parents=True, exist_ok=True)
    return d


def asset_dump(b: "Bench", fname: str) -> Path | None:
    """A dump of the composefs test assets, decompressed once per run (None if absent)."""
    import gzip

    src = b.assets / fname
    if not src.is_file():
        return None
    dest = shared_dir(b) / fname.removesuffix(".gz")
    if not dest.is_file():
        tmp = dest.with_name(dest.name + ".tmp")
        with (gzip.open(src, "rb") if fname.endswith(".gz") else open(src, "rb")) as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        os.replace(tmp, dest)
    return dest


def write_tenfold_dump(src: Path, dest: Path, copies: int = 10) -> int:
    """Writes `src` (a dump) `copies` times under /d0, /d1, ... of one root:
    every path (and every hardlink target) prefixed; returns the entries."""
    with open(src, "rb") as f:
        lines = [ln for ln in f.read().split(b"\n") if ln]
    if not lines or lines[0].split(b" ", 1)[0] != b"/":
        raise ValueError(f"{src}: the first line is not the root")
    root_rest = lines[0].split(b" ", 1)[1]
    n = 1
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(lines[0] + b"\n")
        for i in range(copies):
            prefix = b"/d%d" % i
            out.write(prefix + b" " + root_rest + b"\n")
            n += 1
            chunk = []
            for ln in lines[1:]:
                f = ln.split(b" ", 9)
                f[0] = prefix + f[0]
                if len(f) > 8 and f[2].startswith(b"@") and f[8] != b"-":
                    f[8] = prefix + (f[8] if f[8].startswith(b"/") else b"/" + f[8])
                chunk.append(b" ".join(f))
            out.write(b"\n".join(chunk) + b"\n")
            n += len(chunk)
    os.replace(tmp, dest)
    return n


TENFOLD_SOURCE = "cs9-x86_64-developer.dump.gz"


def tenfold_dump(b: "Bench") -> tuple[Path, int] | None:
    """The cs9-x86_64-developer dump ten times over under /d0../d9 of one root
    (642k entries), made once per run: (path, entries), or None without the
    assets. The build section times building it; a fuse row can mount
    tenfold_image()."""
    d = shared_dir(b) / "cs9x10.dump"
    count = shared_dir(b) / "cs9x10.entries"
    if not d.is_file():
        src = asset_dump(b, TENFOLD_SOURCE)
        if src is None:
            return None
        count.write_text(str(write_tenfold_dump(src, d)))
    return d, int(count.read_text())


def tenfold_image(b: "Bench") -> Path | None:
    """tilefs's image of tenfold_dump() (built untimed, once per run)."""
    t = tenfold_dump(b)
    if t is None:
        return None
    img = shared_dir(b) / "cs9x10.img"
    if not img.is_file():
        subprocess.run([b.tilefs, "build", "--quiet", "--from-dump", str(t[0]), str(img)], check=True,
                       stdin=subprocess.DEVNULL)
    return img


# ---------------------------------------------------------------------------
# Machine facts.
# ---------------------------------------------------------------------------

FACT_LABELS = [
    ("date", "date (UTC)"),
    ("host", "host"),
    ("cpu_model", "CPU"),
    ("nproc", "cores (nproc)"),
    ("memory", "memory"),
    ("kernel", "kernel"),
    ("os", "OS"),
    ("virtualization", "virtualization"),
    ("loadavg_start", "load average at start"),
    ("loadavg_end", "load average at end"),
    ("git_commit", "tilefs commit"),
    ("tilefs_bin", "tilefs binary"),
    ("tilefs_version", "tilefs version"),
    ("tilefs_build", "tilefs build"),
    ("reference", "reference (composefs)"),
    ("reference_build", "reference build"),
    ("cfsctl", "cfsctl (composefs-rs)"),
    ("cfsctl_build", "cfsctl build"),
    ("fsverity", "fsverity"),
    ("openssl", "openssl"),
    ("rss_method", "peak RSS from"),
    ("user", "user"),
    ("duration_s", "duration"),
]


def capture(argv: Sequence[str], cwd: Path | None = None) -> str | None:
    try:
        r = subprocess.run(
            [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def read_first(path: str, pattern: str) -> str | None:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    m = re.search(pattern, text, re.M)
    return m.group(1).strip() if m else None


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine_facts() -> dict:
    f: dict = {}
    f["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    f["host"] = platform.node()
    f["cpu_model"] = read_first("/proc/cpuinfo", r"^model name\s*:\s*(.*)$") or platform.processor() or "?"
    n = os.cpu_count()
    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:
        avail = n
    f["nproc"] = f"{avail}" + (f" (of {n} online)" if avail != n else "")
    kib = read_first("/proc/meminfo", r"^MemTotal:\s*(\d+)")
    f["memory"] = f"{int(kib) / 1048576:.1f} GiB" if kib else "?"
    f["kernel"] = f"{platform.system()} {platform.release()} {platform.machine()}"
    f["os"] = read_first("/etc/os-release", r'^PRETTY_NAME="?([^"\n]*)"?') or "?"
    virt = capture(["systemd-detect-virt"])
    if not virt:
        virt = read_first("/proc/cpuinfo", r"^flags\s*:.*\b(hypervisor)\b")
    f["virtualization"] = virt or "none detected"
    f["loadavg_start"] = loadavg()
    commit = capture(["git", "rev-parse", "HEAD"], cwd=REPO)
    if commit:
        subject = capture(["git", "log", "-1", "--format=%s"], cwd=REPO) or ""
        dirty = capture(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
        f["git_commit"] = commit[:12] + (" + uncommitted changes" if dirty else "") + (f" ({subject[:60]})" if subject else "")
        f["git_commit_full"] = commit
        f["git_dirty"] = bool(dirty)
    else:
        f["git_commit"] = "unknown (not a git checkout)"
    f["user"] = f"uid {os.getuid()}" + (" (root)" if os.getuid() == 0 else "")
    f["python"] = platform.python_version()
    return f


# ---------------------------------------------------------------------------
# Signals and output files.
# ---------------------------------------------------------------------------


def install_signal_handlers() -> None:
    def handler(signum, _frame):
        kill_current_child()
        raise Interrupted(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def processes_naming(needle: str) -> list[int]:
    """The processes (but this one) with `needle` in an argument: what a
    section started below its directory, to end after a failure."""
    me = os.getpid()
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit() or int(e) == me:
            continue
        try:
            argv = Path(f"/proc/{e}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(needle.encode() in a for a in argv):
            out.append(int(e))
    return out


def build_peer(b, name: str, var: str) -> tuple[Path | None, str]:
    """bench/NAME/build.sh: the peer's directory and how it was built, or
    None and why not."""
    script = BENCH_DIR / name / "build.sh"
    b.progress(f"building the {name} peer (bench/{name}/build.sh) if absent ...", final=False)
    r = subprocess.run([str(script)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        lines = [l for l in (r.stderr + r.stdout).splitlines() if l.strip()]
        return None, f"{name} could not be built (bench/{name}/build.sh, ${var}): " + " / ".join(lines[-3:])
    d = Path(r.stdout.strip().splitlines()[-1])
    return d, (d / "BUILD").read_text().strip()
