"""Section build: `tilefs build` against `mkcomposefs`, from dump files and from a directory."""

import gzip
import os
import shutil
import stat
from pathlib import Path

NAME = "build"
TITLE = "image build, tilefs build vs mkcomposefs"
ORDER = 10

# (row id, asset file, goal: tilefs time <= goal x reference time)
DUMPS = [
    ("config", "config.dump.gz", None),
    ("cs9-minimal", "cs9-x86_64-minimal.dump.gz", None),
    ("cs9-developer", "cs9-x86_64-developer.dump.gz", 0.5),
]
DIR_GOAL = 0.5


def run(b) -> None:
    tilefs = b.tilefs
    mk = b.tool("mkcomposefs")
    work = b.tmpdir(NAME)
    t_img, r_img = work / "tilefs.img", work / "mkcomposefs.img"

    # 1. From dump files (decompressed once, outside the timing).
    for key, fname, goal in DUMPS:
        src = b.assets / fname
        title = f"dump: {fname.removesuffix('.gz')}"
        if not src.is_file():
            b.skip(f"dump/{key}", title, f"{src} not found (set TILEFS_ASSETS)")
            continue
        dump = work / fname.removesuffix(".gz")
        with gzip.open(src, "rb") if fname.endswith(".gz") else open(src, "rb") as fin, open(dump, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        with open(dump, "rb") as f:
            entries = sum(1 for _ in f)
        b.compare(
            f"dump/{key}",
            f"{title} ({entries:,} entries, {dump.stat().st_size / 1e6:.1f} MB)",
            [tilefs, "build", "--from-dump", dump, t_img],
            [mk, "--from-file", dump, r_img] if mk else None,
            ref_tool="mkcomposefs",
            outputs=(t_img, r_img),
            goal=goal,
        )
        dump.unlink()

    # 2. From a directory tree, no object store: every file's fs-verity digest
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
        goal=DIR_GOAL,
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
            goal=DIR_GOAL,
            notes=["page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every run"],
        )
    else:
        b.skip("dir/cold", title, "needs root to drop the page cache (echo 3 > /proc/sys/vm/drop_caches)")
    t_img.unlink(missing_ok=True)
    r_img.unlink(missing_ok=True)


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
