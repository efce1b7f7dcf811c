"""Section podman: podman through an additional layer store. From
`podman pull` to a container's first output, in six configurations: as
root, the tilefs layer store (`tilefs layer-store`) on an ordinary gzip
image with a `tilefs index`, the tilefs layer store on the image's eStargz
conversion, stargz-store (stargz-snapshotter's additional layer store) on
that eStargz image, and podman's own pull of the ordinary image into its
overlay storage; rootless (a user the section makes, with subordinate ids,
removed at the end), the tilefs layer store in `podman unshare` and
podman's own pull. Then the disk two images sharing 90% of their files take, every
file read once, with the tilefs layer store and with podman's overlay
storage.

The image is the cri_lazy section's (its `stage`: this machine's
/usr/share, /usr/include and /usr/bin in three gzip layers, generated files
up to BENCH_CRI_IMAGE_MB (1000) of compressed layers, busybox), pushed to
Debian's docker-registry on loopback; untimed: `tilefs index`, the eStargz
conversion (bench/stargz: `stargz-convert`, estargz.Build's defaults).
stargz-store is the project's command at v0.6.4, the last whose layer
store answers podman 4.3.1's lookups (bench/stargz-store/README.md). Each
run starts from nothing: podman on a new graphroot and runroot (its own
storage.conf, registries.conf, containers.conf and policy), a new layer
store (a new tilefs store and state; a new stargz-store root) started and
mounted untimed. Timed: `podman pull -q` of the image, then `podman run
--rm --network none IMAGE cat /usr/lib/os-release` until the first line of
its output reaches the script (a FIFO); the container's removal is left
out. After each run podman's storage is reset, the layer store unmounted
and every directory of the run removed. The configurations are
interleaved, the order rotated every round. The disk rows: two images of
one layer each, BENCH_PODMAN_SHARED_MB (200) of generated files of which
90% (by count and bytes) are the same files in both, and busybox; both
pulled, every file read (`cat` in a container), then `du -sxB1` of
everything the configuration keeps (tilefs: its store, its state and
podman's graphroot; podman: its graphroot), as root.
BENCH_PODMAN_PEERS (space-separated keys: tilefs tilefs-esgz stargz podman
tilefs-rootless podman-rootless) measures only some.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import lib  # noqa: E402
from containers import Layout, Registry, kill9, sh, stage_image, terminate, unmount_below, wait_for  # noqa: E402

NAME = "podman"
TITLE = "podman: tilefs layer store vs stargz-store and podman's own pull"
ORDER = 40
FIRST_FILE = "usr/lib/os-release"
# The trees of cri_lazy's image (the same image: its numbers compare).
CRI_TREES = ["usr/share", "usr/include", "usr/bin"]
GOAL_VS_PODMAN = 0.3
GOAL_VS_STARGZ = 1.0
GOAL_DISK = 0.6


class User:
    """A user made for the rootless runs (with subordinate ids, as rootless
    podman needs); removed with its home and processes by remove()."""

    def __init__(self):
        self.name = f"tfbench{os.getpid()}"
        sh(["useradd", "-m", "-s", "/bin/sh", self.name])
        ids = lambda f: any(l.startswith(self.name + ":") for l in Path(f).read_text().splitlines())
        if not ids("/etc/subuid") or not ids("/etc/subgid"):
            sh(["usermod", "--add-subuids", "500000-565535", "--add-subgids", "500000-565535", self.name])
        self.home = Path(f"/home/{self.name}")
        self.runtime = self.home / "runtime"
        self.runtime.mkdir(mode=0o700)
        self.own(self.runtime)

    def own(self, path: Path) -> None:
        sh(["chown", "-R", f"{self.name}:{self.name}", path])

    def argv(self, env: dict, argv: list) -> list:
        """`argv` run as the user, with its HOME and XDG_RUNTIME_DIR and `env`."""
        return ["runuser", "-u", self.name, "--", "env", f"HOME={self.home}", f"XDG_RUNTIME_DIR={self.runtime}",
                *(f"{k}={v}" for k, v in env.items()), *map(str, argv)]

    def kill_all(self) -> None:
        for _ in range(50):
            r = subprocess.run(["pgrep", "-u", self.name], capture_output=True, text=True)
            pids = [int(p) for p in r.stdout.split()]
            if not pids:
                return
            for pid in pids:
                kill9(pid)
            time.sleep(0.1)

    def remove(self) -> None:
        self.kill_all()
        subprocess.run(["userdel", "-r", self.name], capture_output=True)


class Run:
    """One configuration's podman and layer store, in a directory of their
    own (root's, or a user's for a rootless run)."""

    def __init__(self, work: Path, tilefs: str, stargz: Path | None, registry: str):
        self.work, self.tilefs, self.stargz, self.registry = work, tilefs, stargz, registry
        self.dir: Path | None = None
        self.store_proc: subprocess.Popen | None = None
        self.user: User | None = None
        self.rootless = False
        self.n = 0

    def path(self, rel: str) -> Path:
        return self.dir / rel

    def containers_env(self) -> dict:
        return {k: str(self.path(f)) for k, f in [("CONTAINERS_STORAGE_CONF", "storage.conf"),
                                                   ("CONTAINERS_REGISTRIES_CONF", "registries.conf"),
                                                   ("CONTAINERS_CONF", "containers.conf")]}

    def argv(self, argv: list) -> list:
        """`argv` run by this run's podman user, in its environment."""
        if self.rootless:
            return self.user.argv(self.containers_env(), argv)
        return ["env", *(f"{k}={v}" for k, v in self.containers_env().items()), *map(str, argv)]

    def podman(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(["podman", *args]), capture_output=True, check=check, timeout=600)

    def start(self, kind: str, rootless: bool = False) -> None:
        """A fresh podman (and layer store: kind "tilefs", "stargz" or
        "none"), root's or, `rootless`, the bench user's."""
        self.stop()
        self.n += 1
        if rootless and self.user is None:
            self.user = User()
        self.rootless = rootless
        self.dir = (self.user.home if rootless else self.work) / f"run-{self.n}"
        self.dir.mkdir()
        mnt = self.path("mnt")
        als = f'additionallayerstores = ["{mnt}:ref"]\n' if kind != "none" else ""
        self.path("storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.path("graph")}"\nrunroot = "{self.path("runroot")}"\n'
            f"[storage.options]\n{als}")
        self.path("registries.conf").write_text(f'[[registry]]\nlocation = "{self.registry}"\ninsecure = true\n')
        self.path("policy.json").write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
        # A root without CAP_SYS_RESOURCE cannot raise podman's default limits.
        self.path("containers.conf").write_text(
            '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n'
            '[engine]\nevents_logger = "file"\n')
        if rootless:
            # The user's own copy (root's checkout may be closed to it).
            shutil.copy(self.tilefs, self.path("tilefs"))
            mnt.mkdir()
            self.user.own(self.dir)
        if kind == "tilefs":
            mnt.mkdir(exist_ok=True)
            # Rootless: in podman's user namespace, where podman sees it.
            unshare = ["podman", "unshare", self.path("tilefs")] if rootless else [self.tilefs]
            sh(self.argv([*unshare, "layer-store", "--mount", mnt, "--store", self.path("store"), "--state",
                          self.path("state"), "--registries-conf", self.path("registries.conf"),
                          "--signature-policy", self.path("policy.json"), "--log", self.path("layer-store.log")]))
        elif kind == "stargz":
            mnt.mkdir()
            log = open(self.path("stargz-store.log"), "ab")
            self.store_proc = subprocess.Popen([str(self.stargz / "stargz-store"), "--root", str(self.path("sroot")),
                                                "--log-level", "warn", str(mnt)], stdout=log, stderr=log)
            wait_for(lambda: lib.is_mountpoint(mnt), "stargz-store's mount", 30)

    def timed(self, image: str) -> str:
        """The timed script (run by root): pull, run until the first line
        of output (as the user, rootless)."""
        script = self.path("timed.sh")
        env = " ".join(f"{k}='{v}'" for k, v in self.containers_env().items())
        fifo, out, rc = self.path("fifo"), self.path("out"), self.path("rc")
        script.write_text(
            f"set -e\nexport {env}\n"
            f"podman pull -q --signature-policy '{self.path('policy.json')}' '{image}' > /dev/null\n"
            f"mkfifo '{fifo}'\n"
            f"(set +e; podman run --rm --network none '{image}' /bin/cat /{FIRST_FILE} > '{fifo}' "
            f"2> '{self.path('run.err')}'; echo $? > '{rc}') < /dev/null > /dev/null 2>&1 &\n"
            f"head -n 1 '{fifo}' > '{out}'\n"
            f"test -s '{out}'\n")
        if not self.rootless:
            return script.read_text()
        self.user.own(script)
        return "exec " + " ".join(f"'{a}'" for a in self.user.argv({}, ["sh", script])) + "\n"

    def wait_run(self) -> None:
        """The container of the timed run has gone (its removal done)."""
        if self.dir is not None and self.path("timed.sh").exists() and self.path("out").exists():
            wait_for(lambda: self.path("rc").exists(), "podman run's end", 120)

    def stop(self) -> None:
        if self.dir is None:
            return
        try:
            self.wait_run()
        except RuntimeError:
            pass
        self.podman("system", "reset", "--force", check=False)
        mnt = self.path("mnt")
        if self.store_proc is not None:
            terminate(self.store_proc)
            self.store_proc = None
        elif self.rootless:
            # The layer store's mount is in podman's namespace, which the
            # reset ended; what is left of the user's processes goes too.
            self.user.kill_all()
        elif lib.is_mountpoint(mnt):
            subprocess.run([self.tilefs, "umount", str(mnt)], capture_output=True)
        for pid in lib.processes_naming(str(self.dir)):
            kill9(pid)
        unmount_below(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def close(self) -> None:
        self.stop()
        if self.user is not None:
            self.user.remove()
            self.user = None


def du(*paths: Path) -> int:
    have = [str(p) for p in paths if p.exists()]
    if not have:
        return 0
    out = sh(["du", "-scxB1", *have]).stdout.decode().splitlines()
    return int(out[-1].split()[0])


def shared_images(layout: Layout, nbytes: int) -> str:
    """Images "a" and "b": one layer each of generated files, 90% of them
    (by count and bytes) the same in both, and a busybox layer."""
    rng = random.Random(47)
    sizes = []
    left = nbytes
    while left > 0:
        n = min(left, int(2 ** rng.uniform(12, 21)))
        sizes.append(n)
        left -= n
    # Every tenth file differs between the images.
    own = set(range(0, len(sizes), 10))

    def layer(name: str, seed: int) -> tuple[dict, str]:
        data = random.Random(seed)
        shared = random.Random(4747)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for i, n in enumerate(sizes):
                if i % 100 == 0:
                    d = tarfile.TarInfo(f"data/{i // 100:03d}")
                    d.type, d.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(d)
                body = shared.randbytes(n)
                if i in own:
                    body = data.randbytes(n)
                info = tarfile.TarInfo(f"data/{i // 100:03d}/{i:05d}.bin")
                info.size, info.mode = n, 0o644
                tar.addfile(info, io.BytesIO(body))
        return layout.layer_of(buf.getvalue())

    bb_dir = layout.root.parent / "bb-shared"
    (bb_dir / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", bb_dir / "bin" / "busybox")
    for app in ["sh", "cat", "find"]:
        os.symlink("busybox", bb_dir / "bin" / app)
    bb = layout.layer_from(["tar", "-C", bb_dir, "-cf", "-", "--numeric-owner", "--mtime=@0", "bin"])
    shutil.rmtree(bb_dir)
    for name, seed in [("a", 1), ("b", 2)]:
        layout.image(name, [layer(name, seed), bb], {"Cmd": ["/bin/sh"]})
    return (f"{len(sizes)} files, {nbytes / 1e6:.0f} MB per image, every tenth file ({len(own)}, "
            f"{sum(sizes[i] for i in own) / 1e6:.0f} MB) its own, the rest the same bytes in both")


def run(b) -> None:
    tools = {t: shutil.which(t) for t in ["podman", "docker-registry", "skopeo", "tar", "du"]}
    missing = [t for t, p in tools.items() if not p]
    if os.geteuid() != 0 or missing or not Path("/bin/busybox").exists():
        why = "needs root" if os.geteuid() != 0 else f"missing: {', '.join(missing) or 'busybox-static'}"
        b.skip("podman/first-output", "podman pull + run to the first output", why +
               " (scripts/setup installs the tools)")
        return
    work = b.tmpdir(NAME)
    registry = Registry(work)
    rig = None
    try:
        convert_dir, convert_build = lib.build_peer(b, "stargz", "STARGZ_BIN_DIR")
        store_dir, store_build = lib.build_peer(b, "stargz-store", "STARGZ_STORE_BIN_DIR")
        for d, why in [(convert_dir, convert_build), (store_dir, store_build)]:
            if d is None:
                b.note(why)
        rig = Run(work, b.tilefs, store_dir, registry.addr)
        _run(b, work, registry, rig, convert_dir, store_build)
    finally:
        if rig is not None:
            rig.close()
        for pid in lib.processes_naming(str(work)):
            if registry.proc is None or pid != registry.proc.pid:
                kill9(pid)
        unmount_below(work)
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)


def _run(b, work: Path, registry: Registry, rig: Run, convert_dir: Path | None, stargz_build: str) -> None:
    tilefs = b.tilefs
    layout, what = stage_image(b, work, CRI_TREES, FIRST_FILE)
    registry.start()
    repo = f"{registry.addr}/bench/usr"
    plain, esgz = f"{repo}:v1", f"{repo}:esgz"
    sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{layout.root}:usr", f"docker://{plain}"])
    b.progress("tilefs index ...", final=False)
    r = subprocess.run([str(a) for a in [tilefs, "index", "-q", "--tls-verify=false", "--store",
                                           work / "index-store", f"docker://{plain}"]], capture_output=True, text=True)
    shutil.rmtree(work / "index-store", ignore_errors=True)
    images = {"podman": plain}
    if r.returncode == 0:
        images["tilefs"] = plain
    else:
        b.note(f"tilefs index failed: {r.stderr.strip()[-300:]}")
    if convert_dir is not None:
        b.progress("eStargz conversion (stargz-convert) ...", final=False)
        r = subprocess.run([str(convert_dir / "stargz-convert"), str(layout.root), "usr", str(work / "esgz")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{work / 'esgz'}:usr", f"docker://{esgz}"])
            images["tilefs-esgz"] = esgz
            if rig.stargz is not None:
                images["stargz"] = esgz
        else:
            b.note(f"the eStargz conversion failed: {r.stderr.strip()[-500:]}")
        shutil.rmtree(work / "esgz", ignore_errors=True)
    shutil.rmtree(layout.root)

    labels = {
        "tilefs": ("tilefs layer store (ordinary image + tilefs index)", "tilefs"),
        "tilefs-esgz": ("tilefs layer store (eStargz)", "tilefs"),
        "stargz": ("stargz-store (eStargz)", "stargz"),
        "podman": ("podman's own pull (overlay)", "none"),
        "tilefs-rootless": ("rootless: tilefs layer store in podman unshare (ordinary image + tilefs index)",
                            "tilefs"),
        "podman-rootless": ("rootless: podman's own pull (overlay)", "none"),
    }
    images["tilefs-rootless"], images["podman-rootless"] = images.get("tilefs"), plain
    wanted = (os.environ.get("BENCH_PODMAN_PEERS") or " ".join(labels)).split()
    keys = [k for k in labels if images.get(k) and k in wanted]
    series = {k: lib.Series(labels[k][0], ["sh", str(work / f"timed-{k}.sh")]) for k in keys}
    bytes_of = {k: [] for k in keys}
    current = {}

    def account() -> None:
        key = current.pop("key", None)
        if key is not None:
            try:
                rig.wait_run()
            except RuntimeError:
                pass
            out = rig.path("out").read_text(errors="replace") if rig.path("out").exists() else ""
            if out and "Debian" not in out and series[key].error is None:
                series[key].error = f"unexpected output: {out[:200]!r}"
            bytes_of[key].append(registry.blob_bytes_since(current["line"]))
        rig.stop()

    def prepare(key: str) -> None:
        account()
        try:
            rig.start(labels[key][1], rootless=key.endswith("-rootless"))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            err = e.stderr.decode(errors="replace") if isinstance(e, subprocess.CalledProcessError) else str(e)
            series[key].error = f"could not start: {err.strip()[-300:]}"
            return
        current["key"] = key
        current["line"] = registry.lines()
        (work / f"timed-{key}.sh").write_text(rig.timed(images[key]))

    b.progress(f"image: {what}", final=True)
    title = f"podman pull + podman run to the first output of `cat /{FIRST_FILE}` (root unless rootless)"
    b.interleave(title, series, cold=False, prepare=prepare)
    account()
    notes = [
        "each run: podman 4.3.1 on a new graphroot and runroot, a new layer store (tilefs: new store and state; "
        "stargz-store: new root) mounted untimed; timed: `podman pull -q`, then `podman run --rm --network none` "
        "until the first line of output reaches the script through a FIFO (the container's removal left out); "
        "configurations interleaved, the order rotated every round; medians",
        f"image: {what}",
    ]

    def row(id: str, t: str, ref: str, goal: float, why: str) -> None:
        if t not in series or ref not in series:
            return
        r = lib.Row(b.section, id, f"{title}: {labels[t][0]} vs {labels[ref][0]}", tilefs=series[t],
                    ref=series[ref], ref_tool=labels[ref][0], goal=goal, notes=[why, *notes])
        b.rows.append(r)
        b.progress(lib.summary_line(r))

    row("podman/vs-podman", "tilefs", "podman", GOAL_VS_PODMAN,
        f"goal: tilefs layer store <= {GOAL_VS_PODMAN} x podman's own pull of the same image")
    row("podman/vs-stargz", "tilefs", "stargz", GOAL_VS_STARGZ,
        "goal: tilefs on the ordinary image <= stargz-store on its eStargz conversion; stargz-store: "
        + stargz_build)
    row("podman/esgz-vs-stargz", "tilefs-esgz", "stargz", GOAL_VS_STARGZ,
        "goal: tilefs <= stargz-store, both on the eStargz image (tilefs from its tables of contents)")
    row("podman/rootless-vs-podman", "tilefs-rootless", "podman-rootless", GOAL_VS_PODMAN,
        f"goal: rootless, tilefs layer store <= {GOAL_VS_PODMAN} x podman's own pull; a user made for the "
        "section (subordinate ids), the layer store in `podman unshare`, the timed script run by `runuser`")
    med = {k: sorted(v)[len(v) // 2] for k, v in bytes_of.items() if v}
    if med:
        b.info("podman/bytes", "blob bytes the registry sent from the pull's start to the first output (median)",
               "; ".join(f"{labels[k][0]} {m / 1e6:.2f} MB" for k, m in med.items()),
               {k: {"median_bytes": m, "runs": bytes_of[k]} for k, m in med.items()})
    _disk(b, work, registry, rig)


def _disk(b, work: Path, registry: Registry, rig: Run) -> None:
    """Disk used by two images sharing 90% of their files, every file read."""
    layout = Layout(work / "shared-layout")
    nbytes = lib.env_int("BENCH_PODMAN_SHARED_MB", 200) * 1_000_000
    b.progress("images sharing 90% of their files ...", final=False)
    what = shared_images(layout, nbytes)
    refs = []
    for name in ["a", "b"]:
        ref = f"{registry.addr}/bench/shared-{name}:v1"
        sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{layout.root}:{name}", f"docker://{ref}"])
        sh([b.tilefs, "index", "-q", "--tls-verify=false", "--store", work / "index-store", f"docker://{ref}"])
        refs.append(ref)
    shutil.rmtree(work / "index-store", ignore_errors=True)
    shutil.rmtree(layout.root)
    used, errors = {}, {}
    for kind in ["tilefs", "none"]:
        try:
            rig.start(kind)
            for ref in refs:
                rig.podman("pull", "-q", "--signature-policy", rig.path("policy.json"), ref)
                out = rig.podman("run", "--rm", "--network", "none", ref, "/bin/sh", "-c",
                                 "find /data -type f -exec cat {} + | wc -c")
                if int(out.stdout.split()[0]) != nbytes:
                    raise RuntimeError(f"read {out.stdout.strip()} bytes of {nbytes} in {ref}")
            keep = [rig.path("graph")] + ([rig.path("store"), rig.path("state")] if kind == "tilefs" else [])
            used[kind] = du(*keep)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            err = e.stderr.decode(errors="replace") if isinstance(e, subprocess.CalledProcessError) else str(e)
            errors[kind] = err.strip()[-300:]
        finally:
            rig.stop()
    if "tilefs" in used and "none" in used:
        ratio = used["tilefs"] / used["none"]
        b.info("podman/disk", "disk used by two images sharing 90% of their files, both pulled and every file read: "
               "tilefs layer store vs podman's overlay storage",
               f"tilefs {used['tilefs'] / 1e6:.0f} MB (store, state and podman's graphroot), podman "
               f"{used['none'] / 1e6:.0f} MB (graphroot): {ratio:.2f} x; goal <= {GOAL_DISK}: "
               f"{'met' if ratio <= GOAL_DISK else 'MISSED'}",
               {"tilefs_bytes": used["tilefs"], "podman_bytes": used["none"], "ratio": ratio,
                "goal_met": ratio <= GOAL_DISK},
               notes=[f"images: {what}; du -sxB1 after `podman pull` of both and `cat` of every file in a container"])
    else:
        b.skip("podman/disk", "disk used by two images sharing 90% of their files", "; ".join(
            f"{k}: {v}" for k, v in errors.items()))
