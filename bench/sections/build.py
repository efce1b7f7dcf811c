"""Section build: `tilefs build` against `mkcomposefs` (and composefs-rs's
`cfsctl mkcomposefs`), from dump files and from a directory."""

import os
import stat
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "build"
TITLE = "image build, tilefs build vs mkcomposefs (and cfsctl mkcomposefs)"
ORDER = 10

# (row id, asset file, goal: tilefs time <= goal x reference time)
DUMPS = [
    ("config", "config.dump.gz", None),
    ("cs9-minimal", "cs9-x86_64-minimal.dump.gz", None),
    ("cs9-developer", "cs9-x86_64-developer.dump.gz", 0.4),
]
CFSCTL_DUMP_GOAL = 0.4
DIR_WARM_GOAL = 0.4
DIR_COLD_GOAL = 0.5
# Every build: tilefs peak RSS <= this x the reference's.
RSS_GOAL = 1.2
# The cs9 dump ten times over: peak RSS <= this x the reference's, and the
# time per entry at most this x that of the cs9 dump (linear in entries).
TENFOLD_RSS_GOAL = 0.5
LINEAR_GOAL = 1.25


def run(b) -> None:
    tilefs = b.tilefs
    mk = b.tool("mkcomposefs")
    work = b.tmpdir(NAME)
    t_img, r_img = work / "tilefs.img", work / "reference.img"
    per_entry = {}

    # 1. From dump files (decompressed once, outside the timing).
    for key, fname, goal in DUMPS:
        title = f"dump: {fname.removesuffix('.gz')}"
        dump = lib.asset_dump(b, fname)
        if dump is None:
            b.skip(f"dump/{key}", title, f"{b.assets / fname} not found (set TILEFS_ASSETS)")
            continue
        entries = count_lines(dump)
        row = b.compare(
            f"dump/{key}",
            f"{title} ({entries:,} entries, {dump.stat().st_size / 1e6:.1f} MB)",
            [tilefs, "build", "--from-dump", dump, t_img],
            [mk, "--from-file", dump, r_img] if mk else None,
            ref_tool="mkcomposefs",
            outputs=(t_img, r_img),
            goal=goal,
            rss_goal=RSS_GOAL,
        )
        if key == "cs9-developer":
            if row.tilefs.ok:
                per_entry["cs9"] = row.tilefs.median() / entries
            cfsctl_dump(b, dump, work)

    # 2. The cs9 dump ten times over, under /d0../d9 of one root (made once,
    #    untimed; lib.tenfold_dump, which other sections may reuse).
    t = lib.tenfold_dump(b)
    if t is None:
        b.skip("dump/cs9x10", "dump: cs9-x86_64-developer x10", f"{b.assets / lib.TENFOLD_SOURCE} not found")
    else:
        dump, entries = t
        row = b.compare(
            "dump/cs9x10",
            f"dump: cs9-x86_64-developer ten times under /d0../d9 ({entries:,} entries, {dump.stat().st_size / 1e6:.0f} MB)",
            [tilefs, "build", "--from-dump", dump, t_img],
            [mk, "--from-file", dump, r_img] if mk else None,
            ref_tool="mkcomposefs",
            outputs=(t_img, r_img),
            rss_goal=TENFOLD_RSS_GOAL,
        )
        if row.tilefs.ok and "cs9" in per_entry:
            per_entry["cs9x10"] = row.tilefs.median() / entries
            ratio = per_entry["cs9x10"] / per_entry["cs9"]
            met = "✓ met" if ratio <= LINEAR_GOAL else "✗ **missed**"
            b.info(
                "dump/linear",
                "time per entry, cs9 x10 / cs9 (linear in entries: 1)",
                f"{ratio:.2f} ({per_entry['cs9x10'] * 1e6:.2f} vs {per_entry['cs9'] * 1e6:.2f} µs an entry; goal ≤ {LINEAR_GOAL:g} {met})",
                value_json={"ratio": round(ratio, 4), "goal_max": LINEAR_GOAL, "goal_met": ratio <= LINEAR_GOAL,
                            "us_per_entry": {k: round(v * 1e6, 4) for k, v in per_entry.items()}},
            )
    for p in (t_img, r_img):
        p.unlink(missing_ok=True)

    # 3. From a directory tree, no object store: every file's fs-verity digest
    #    is computed (both tools use every core by default).
    tree = Path(os.environ.get("BENCH_TREE") or "/usr/share")
    if not tree.is_dir():
        b.skip("dir/warm", f"directory: {tree}", f"{tree} is not a directory (set BENCH_TREE)")
        return
    entries, nbytes, unreadable = scan(tree)
    desc = f"{tree} ({entries:,} entries, {nbytes / 1e6:,.0f} MB in regular files)"
    notes = [f"{unreadable} entries unreadable by this user"] if unreadable else []
    tilefs_argv = [tilefs, "build", tree, t_img]
    ref_argv = [mk, tree, r_img] if mk else None
    b.compare(
        "dir/warm",
        f"directory, warm cache: {desc}",
        tilefs_argv,
        ref_argv,
        ref_tool="mkcomposefs",
        outputs=(t_img, r_img),
        goal=DIR_WARM_GOAL,
        rss_goal=RSS_GOAL,
        notes=notes,
    )
    cfs = b.tool("cfsctl")
    if cfs:
        b.compare(
            "dir/warm-cfsctl",
            f"directory, warm cache, vs composefs-rs: {tree}",
            tilefs_argv,
            [cfs, "mkcomposefs", tree, r_img],
            ref_tool="cfsctl",
            outputs=(t_img, r_img),
            notes=notes,
        )
    title = f"directory, cold cache: {tree}"
    if b.can_drop_caches():
        b.compare(
            "dir/cold",
            title,
            tilefs_argv,
            ref_argv,
            ref_tool="mkcomposefs",
            outputs=(t_img, r_img),
            cold=True,
            goal=DIR_COLD_GOAL,
            rss_goal=RSS_GOAL,
            notes=["page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every run"],
        )
    else:
        b.skip("dir/cold", title, "needs root to drop the page cache (echo 3 > /proc/sys/vm/drop_caches)")
    t_img.unlink(missing_ok=True)
    r_img.unlink(missing_ok=True)


def cfsctl_dump(b, dump: Path, work: Path) -> None:
    """cs9-x86_64-developer built by tilefs and by `cfsctl mkcomposefs --from-file`
    (composefs-rs's C-compatible builder, a hidden subcommand of cfsctl)."""
    cfs = b.tool("cfsctl")
    rid, title = "dump/cs9-developer-cfsctl", "dump: cs9-x86_64-developer.dump, vs composefs-rs"
    if not cfs:
        b.skip(rid, title, "cfsctl not found (set CFSCTL)")
        return
    env = dict(os.environ, RUST_BACKTRACE="0")
    probe = subprocess.run([cfs, "mkcomposefs", "--help"], capture_output=True, text=True, env=env,
                           stdin=subprocess.DEVNULL)
    if probe.returncode != 0 or "--from-file" not in probe.stdout:
        b.skip(rid, title, "this cfsctl has no `mkcomposefs --from-file`: it cannot build an image from a dump")
        return
    t_img, c_img = work / "tilefs-cfs.img", work / "cfsctl.img"
    notes = []
    tried = subprocess.run([cfs, "mkcomposefs", "--from-file", str(dump), str(c_img)], capture_output=True,
                           text=True, env=env, stdin=subprocess.DEVNULL)
    if tried.returncode != 0:
        why = next((ln.strip() for ln in reversed(tried.stderr.splitlines()) if ln.strip()), f"exit {tried.returncode}")
        variant = work / "cs9-rs.dump"
        n = write_rs_variant(dump, variant)
        notes.append(
            f"cfsctl refuses the original dump ({why}): its object paths are `XX/<62 hex>.file`. Both tools "
            f"build a copy where each of the {n:,} external files' payload is `XX/<62 hex>` and its digest "
            "the same 64 hex digits (SHA-256 of the original payload); the tree is the same"
        )
        dump = variant
        title += " (object paths as composefs-rs takes them)"
    b.compare(
        rid,
        f"{title} ({count_lines(dump):,} entries)",
        [b.tilefs, "build", "--from-dump", dump, t_img],
        [cfs, "mkcomposefs", "--from-file", dump, c_img],
        ref_tool="cfsctl",
        outputs=(t_img, c_img),
        goal=CFSCTL_DUMP_GOAL,
        rss_goal=RSS_GOAL,
        notes=notes,
    )
    for p in (t_img, c_img):
        p.unlink(missing_ok=True)


def write_rs_variant(src: Path, dest: Path) -> int:
    """Copies a dump with every regular file's payload (an object path) in the
    form composefs-rs accepts, `XX/` + 62 hex digits, and its DIGEST set to
    the same 64 digits: the SHA-256 of the original payload, so files that
    shared an object still do. Returns how many payloads were rewritten."""
    import hashlib

    n = 0
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        for line in fin:
            f = line.rstrip(b"\n").split(b" ")
            if (
                len(f) >= 11
                and not f[2].startswith(b"@")
                and f[8] != b"-"
                and int(f[2], 8) & 0o170000 == 0o100000
            ):
                h = hashlib.sha256(f[8]).hexdigest().encode()
                f[8] = h[:2] + b"/" + h[2:]
                f[10] = h
                n += 1
            fout.write(b" ".join(f) + b"\n")
    return n


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def scan(root: Path) -> tuple[int, int, int]:
    """Counts entries and regular-file bytes under root (symlinks not followed)."""
    entries = nbytes = unreadable = 0
    stack = [str(root)]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            unreadable += 1
            continue
        with it:
            for e in it:
                entries += 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    unreadable += 1
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode):
                    nbytes += st.st_size
                    if not os.access(e.path, os.R_OK):
                        unreadable += 1
    return entries, nbytes, unreadable
