"""Section store: importing a tree into an object store, tilefs build --store vs mkcomposefs --digest-store."""

import os
import shutil
import subprocess
from pathlib import Path

NAME = "store"
TITLE = "object store import, tilefs build --store vs mkcomposefs --digest-store"
ORDER = 20

EMPTY_GOAL = 0.5
PRESENT_GOAL = 0.25
# tilefs peak RSS <= this x the reference's.
RSS_GOAL = 1.2


def run(b) -> None:
    tilefs = b.tilefs
    mk = b.tool("mkcomposefs")
    work = b.tmpdir(NAME)
    tree = Path(os.environ.get("BENCH_TREE") or "/usr/share")
    if not tree.is_dir():
        b.skip("store/empty", f"store import: {tree}", f"{tree} is not a directory (set BENCH_TREE)")
        return
    t_store, r_store = work / "tilefs-store", work / "ref-store"
    t_img, r_img = work / "tilefs.img", work / "ref.img"
    t_argv = [tilefs, "build", "--quiet", "--store", t_store, tree, t_img]
    r_argv = [mk, f"--digest-store={r_store}", tree, r_img] if mk else None

    def empty(role: str) -> None:
        shutil.rmtree(t_store if role == "tilefs" else r_store, ignore_errors=True)

    cold = b.can_drop_caches()
    note = "page cache dropped before every run" if cold else "warm cache (dropping caches needs root)"
    b.compare(
        "store/empty",
        f"{tree} into an empty store ({note})",
        t_argv,
        r_argv,
        ref_tool="mkcomposefs",
        outputs=(t_img, r_img),
        cold=cold,
        prepare=empty,
        goal=EMPTY_GOAL,
        rss_goal=RSS_GOAL,
        notes=["both make every object durable before naming it (reference: fsync per object; tilefs: syncfs per batch)"],
    )
    # Every object present (the stores the previous row left behind).
    for s, argv in ((t_store, t_argv), (r_store, r_argv)):
        if argv and not s.is_dir():
            subprocess.run([str(a) for a in argv], check=False, capture_output=True)
    present_note = "tilefs reads no unchanged file: its digest cache maps (dev, ino, size, mtime, ctime) to digests"
    b.compare(
        "store/present-warm",
        f"{tree} again, every object present (warm cache)",
        t_argv,
        r_argv,
        ref_tool="mkcomposefs",
        outputs=(t_img, r_img),
        goal=PRESENT_GOAL,
        rss_goal=RSS_GOAL,
        notes=[present_note],
    )
    if cold:
        b.compare(
            "store/present",
            f"{tree} again, every object present ({note})",
            t_argv,
            r_argv,
            ref_tool="mkcomposefs",
            outputs=(t_img, r_img),
            cold=True,
            goal=PRESENT_GOAL,
            rss_goal=RSS_GOAL,
            notes=[present_note],
        )
    for p in (t_store, r_store):
        shutil.rmtree(p, ignore_errors=True)
    for p in (t_img, r_img):
        p.unlink(missing_ok=True)

    # How close digesting comes to the machine's SHA-256 speed on all cores:
    # a tree of a few large files, warm, no store.
    big = work / "big"
    big.mkdir(exist_ok=True)
    n, size = os.cpu_count() or 2, 256 << 20
    for i in range(n * 2):
        with open(big / f"f{i}", "wb") as f:
            f.write(os.urandom(1 << 20) * (size >> 20))
    total = n * 2 * size
    row = b.compare(
        "store/digest-all-cores",
        f"digest throughput on all cores: {n * 2} files of {size >> 20} MiB, warm, no store",
        [tilefs, "build", "--quiet", big, t_img],
        None,
        ref_tool="openssl",
        ref_missing="ceiling: see the SHA-256 rows of the digest section (openssl, one thread x cores)",
        nbytes=total,
    )
    del row
    shutil.rmtree(big, ignore_errors=True)
    t_img.unlink(missing_ok=True)
