"""Section digest: fs-verity digest throughput of one large file."""

import os
import re
import shutil

import lib

NAME = "digest"
TITLE = "fs-verity digest of one large file, tilefs digest vs fsverity digest"
ORDER = 20


def run(b) -> None:
    mib = lib.env_int("BENCH_DIGEST_MIB", 1024)
    size = mib << 20
    work = b.tmpdir(NAME)
    label = f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"
    title = f"digest, warm cache: one {label} file"

    # The single-thread SHA-256 ceiling of this CPU, for scale.
    ceiling = None
    openssl = b.tool("openssl")
    if openssl:
        b.progress("openssl speed -evp sha256 -bytes 16384 -seconds 2 ...", final=False)
        out = lib.capture([openssl, "speed", "-mr", "-evp", "sha256", "-bytes", "16384", "-seconds", "2"]) or ""
        m = re.search(r"^\+F:\d+:[^:]*:([0-9.]+)", out, re.M)
        if m:
            ceiling = float(m.group(1))  # bytes per second
            b.info(
                "openssl-sha256",
                "SHA-256 ceiling, one thread (openssl speed -evp sha256, 16 KiB blocks)",
                f"{ceiling / 1e6:,.0f} MB/s",
                {"mb_per_s": round(ceiling / 1e6, 1)},
                notes=["fs-verity hashes the data plus ~1/128 more for the Merkle tree: one thread cannot beat this"],
            )
        else:
            b.skip("openssl-sha256", "SHA-256 ceiling (openssl speed)", "could not parse openssl speed output")
    else:
        b.skip("openssl-sha256", "SHA-256 ceiling (openssl speed)", "openssl not found")

    free = shutil.disk_usage(work).free
    if free < size + (256 << 20):
        b.skip("file", title, f"{work} has {free >> 20} MiB free, needs {mib + 256} (set BENCH_TMP or BENCH_DIGEST_MIB)")
        return
    path = work / f"digest-{mib}MiB.bin"
    b.progress(f"writing {path} ({label}) ...", final=False)
    chunk = os.urandom(16 << 20)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())  # clean pages: no writeback during the runs
    del chunk

    fsverity = b.tool("fsverity")
    row = b.compare(
        "file",
        title,
        [b.tilefs, "digest", "--compact", path],
        [fsverity, "digest", "--compact", path] if fsverity else None,
        ref_tool="fsverity",
        ref_missing="fsverity not found (Debian package fsverity): tilefs alone",
        same_stdout=lambda a, c: a.split()[:1] == c.split()[:1] and bool(a.strip()),
        nbytes=size,
    )
    if ceiling and row.tilefs and row.tilefs.ok:
        tput = size / row.tilefs.median()
        row.notes.append(f"tilefs = {tput / ceiling:.2f}x the one-thread SHA-256 ceiling")
    path.unlink(missing_ok=True)
