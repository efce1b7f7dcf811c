"""Section pull: an OCI image into a store, tilefs vs composefs-rs.

The image: this machine's /usr/share, /usr/include and /usr/bin as three
gzip layers (`tar | gzip -6`, untimed) in an OCI layout. Rows:
  - into an empty store, page cache dropped before every run:
    `tilefs pull` vs `cfsctl oci pull` (a fsverity-sha256-12 repository,
    `--insecure`: this machine has no fs-verity), goal <= 0.5x;
  - the same image again, every object present, cold: goal <= 0.3x.
Both tools' images are checked to have the same digest (`cfsctl oci
compute-id`). Peak RSS is in every row.

And the cost of the signature policy (issue 31): the same image in Debian's
docker-registry on loopback, signed by skopeo with a GnuPG key the bench
makes (simple signing, lookaside in a file:// directory), pulled again
with every object present, warm cache: under a policy requiring that
signature (`signedBy`: registries.d, the lookaside read, sequoia's check)
vs under `insecureAcceptAnything`, goal <= 1.05x (at least 15 runs each,
interleaved: a few milliseconds against a loaded machine's noise).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402

NAME = "pull"
TITLE = "OCI pull: three gzip layers of /usr into a store, tilefs vs cfsctl oci pull"
ORDER = 35
TREES = ["usr/share", "usr/include", "usr/bin"]
EMPTY_GOAL = 0.5
PRESENT_GOAL = 0.3
SIGNED_GOAL = 1.05


def put_blob(layout: Path, path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    d = h.hexdigest()
    dest = layout / "blobs" / "sha256" / d
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, dest)
    return f"sha256:{d}", dest.stat().st_size


def put_bytes(layout: Path, data: bytes) -> tuple[str, int]:
    d = hashlib.sha256(data).hexdigest()
    dest = layout / "blobs" / "sha256" / d
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return f"sha256:{d}", len(data)


def make_layout(b, layout: Path) -> int:
    layers, diff_ids = [], []
    for i, t in enumerate(TREES):
        b.progress(f"pull: tar | gzip /{t} ...", final=False)
        raw = layout / "layer.tar"
        # The first layer lists /usr itself (composefs-rs refuses parents no
        # entry lists).
        first = ["--no-recursion", "usr", "--recursion"] if i == 0 else []
        subprocess.run(["tar", "-C", "/", "--numeric-owner", "-cf", str(raw)] + first + [t], check=True,
                       stderr=subprocess.DEVNULL)
        h = hashlib.sha256()
        with open(raw, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        diff_ids.append(f"sha256:{h.hexdigest()}")
        gz = layout / "layer.tar.gz"
        with open(gz, "wb") as out:
            subprocess.run(["gzip", "-6", "-c", str(raw)], stdout=out, check=True)
        raw.unlink()
        d, n = put_blob(layout, gz)
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": n})
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    cd, cn = put_bytes(layout, config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
                           "layers": layers}).encode()
    md, mn = put_bytes(layout, manifest)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
         "annotations": {"org.opencontainers.image.ref.name": "bench"}}]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return sum(l["size"] for l in layers)


def run(b) -> None:
    cfs = b.tool("cfsctl")
    if shutil.which("skopeo") is None and cfs:
        b.note("skopeo not found: cfsctl oci pull needs it")
        cfs = None
    work = b.tmpdir(NAME)
    layout = work / "layout"
    layout.mkdir()
    blob_bytes = make_layout(b, layout)
    ref = f"oci:{layout}:bench"
    t_store, r_repo = work / "tstore", work / "repo"
    t_argv = [b.tilefs, "pull", "-q", "--store", t_store, ref]
    r_argv = [cfs, "--repo", r_repo, "oci", "pull", ref, "bench"] if cfs else None

    def empty(role: str) -> None:
        if role == "tilefs":
            shutil.rmtree(t_store, ignore_errors=True)
        else:
            shutil.rmtree(r_repo, ignore_errors=True)
            subprocess.run([cfs, "init", "--algorithm", "fsverity-sha256-12", "--insecure", str(r_repo)],
                           check=True, capture_output=True)

    cold = b.can_drop_caches()
    note = "page cache dropped before every run" if cold else "warm cache (dropping caches needs root)"
    built = ("cfsctl: composefs-rs v0.9.0, cargo build --release -p composefs-ctl; "
             "repository fsverity-sha256-12 --insecure (no fs-verity here); it fetches through skopeo")
    b.compare("pull/empty", f"{len(TREES)} gzip layers ({blob_bytes >> 20} MiB) into an empty store ({note})",
              t_argv, r_argv, ref_tool="cfsctl", ref_missing="cfsctl not found (set CFSCTL): tilefs alone",
              cold=cold, prepare=empty, goal=EMPTY_GOAL, nbytes=blob_bytes, notes=[built])
    # The same image again, every object present (the last run's stores).
    b.compare("pull/present", f"the same image again, every object present ({note})",
              t_argv, r_argv, ref_tool="cfsctl", ref_missing="cfsctl not found (set CFSCTL): tilefs alone",
              cold=cold, goal=PRESENT_GOAL, nbytes=blob_bytes,
              notes=["cfsctl finds its layers already imported; tilefs finds the image these layers made (STORE/.layers) and checks its objects are present"])
    t = subprocess.run([str(a) for a in t_argv], capture_output=True, text=True)
    if cfs and t.returncode == 0:
        r = subprocess.run([cfs, "--repo", str(r_repo), "oci", "compute-id", "bench"], capture_output=True, text=True)
        same = r.returncode == 0 and r.stdout.strip() == t.stdout.strip()
        b.info("pull/same-image", "tilefs's image digest equals cfsctl oci compute-id",
               "identical" if same else f"DIFFERENT: tilefs {t.stdout.strip()} cfsctl {r.stdout.strip()}")
    signed_pull(b, work, layout, blob_bytes)
    shutil.rmtree(work, ignore_errors=True)


def signed_pull(b, work: Path, layout: Path, blob_bytes: int) -> None:
    title = "the same image again from a registry, every object present, signedBy policy vs insecureAcceptAnything (warm cache)"
    missing = [t for t in ("docker-registry", "skopeo", "gpg") if shutil.which(t) is None]
    if missing:
        b.skip("pull/signed", title, f"{', '.join(missing)} not found (scripts/setup installs them)")
        return
    from sections.registry import Registry  # noqa: E402
    root = work / "registry"
    root.mkdir()
    reg = Registry(root)
    try:
        reg.start(empty=True)
        gnupg, sigs, regd = work / "gnupg", work / "sigs", work / "registries.d"
        for d in (gnupg, sigs, regd):
            d.mkdir(mode=0o700)
        env = dict(os.environ, GNUPGHOME=str(gnupg))
        gpg = ["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", ""]
        subprocess.run(gpg + ["--quick-gen-key", "bench <bench@example.org>", "ed25519", "sign", "never"],
                       env=env, check=True, capture_output=True)
        listing = subprocess.run(gpg + ["--with-colons", "--list-keys", "bench@example.org"], env=env, check=True,
                                 capture_output=True, text=True).stdout
        fpr = next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:"))
        key = work / "bench.gpg"
        key.write_bytes(subprocess.run(gpg + ["--export", fpr], env=env, check=True, capture_output=True).stdout)
        (regd / "bench.yaml").write_text(f"docker:\n  {reg.addr}:\n    lookaside: file://{sigs}\n")
        remote = f"docker://{reg.addr}/bench/usr:v1"
        b.progress("pull: signing the image into the registry ...", final=False)
        subprocess.run(["skopeo", "--insecure-policy", "--registries.d", str(regd), "copy", "-q", "--dest-tls-verify=false",
                        "--sign-by", fpr, f"oci:{layout}:bench", remote], env=env, check=True, capture_output=True)
        signed = work / "signed.json"
        signed.write_text(json.dumps({"default": [{"type": "reject"}], "transports": {"docker": {"": [
            {"type": "signedBy", "keyType": "GPGKeys", "keyPath": str(key)}]}}}))
        accept = work / "accept.json"
        accept.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
        conf = work / "registries.conf"
        conf.write_text("")
        store = work / "rstore"

        def argv(policy: Path) -> list:
            return [b.tilefs, "pull", "-q", "--store", store, "--tls-verify=false", "--registries.d", regd,
                    "--registries-conf", conf, "--signature-policy", policy, remote]
        # Every object present: one pull first, untimed.
        subprocess.run([str(a) for a in argv(signed)], check=True, capture_output=True)
        b.compare("pull/signed", title, argv(signed), argv(accept), ref_tool="tilefs (insecureAcceptAnything)",
                  goal=SIGNED_GOAL, nbytes=blob_bytes, runs=max(b.runs, 15),
                  notes=["both: tilefs from this tree; the reference column is the same pull under a policy that "
                         "checks nothing; skopeo signed the image (simple signing, lookaside file://)"])
    except (subprocess.CalledProcessError, RuntimeError, StopIteration) as e:
        detail = getattr(e, "stderr", b"") or b""
        b.skip("pull/signed", title, f"setup failed: {e} {detail.decode(errors='replace') if isinstance(detail, bytes) else detail}")
    finally:
        reg.stop()
