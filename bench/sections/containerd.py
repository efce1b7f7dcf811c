"""Section containerd: tilefs snapshotter against containerd's own overlayfs
snapshotter, under the same containerd (Debian's), images in Debian's
docker-registry on loopback.

The image: this machine's BENCH_TREE (default /usr/share) in three layers
(its top-level entries split in three, gzip -1), plus busybox to run. A
second image shares 90% of its files: the same trees in layers of other
digests (other tar mtimes, so containerd unpacks them again) plus a layer of
new files, a tenth of the first image's bytes. Rows:
  - pull + unpack (ctr image pull): before every run the image is removed
    with containerd's gc (--sync) and, for tilefs, `tilefs gc` empties the
    store, so both fetch and unpack everything; once with everything on the
    disk, and once with everything (registry, containerd, snapshotter,
    store) on a tmpfs, which leaves out the device: this machine's disk
    varies from run to run by more than the snapshotters differ
    (BENCH_CONTAINERD_TMPFS=0 leaves that row out);
  - `ctr run` to a container's first output, and `ls -lR` of the tree in a
    container (warm);
  - a C build in a container (warm): libgit2 as the writable section builds
    it (cmake configure + make -j2), its sources in a layer of a third image
    whose other layers are this machine's C toolchain (the files of the
    installed Debian packages cmake, make, gcc and libc6-dev need) and the
    merged-/usr links; the build directory is in the container's upper
    directory, as a build in a container writes;
  - disk used by both images: containerd's overlayfs snapshots against the
    tilefs store and the snapshotter's state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import lib  # noqa: E402
import writable  # noqa: E402  (the libgit2 sources and how they are built)
from containers import Layout, Registry, remove_cgroup, sh, terminate, unmount_below, wait_for  # noqa: E402

NAME = "containerd"
TITLE = "containerd: tilefs snapshotter vs containerd's overlayfs snapshotter"
ORDER = 38
PULL_GOAL = 1.0
RUN_GOAL = 1.1
LS_GOAL = 1.05
BUILD_GOAL = 1.05
# The images' configuration: a shell, and the PATH a build needs.
CONFIG = {"Cmd": ["/bin/sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
DISK_GOAL = 0.6
NAMESPACE = "tilefs-bench"


def du(*paths: Path) -> int:
    total = 0
    for p in paths:
        if p.exists():
            out = sh(["du", "-sxB1", p]).stdout.split()[0]
            total += int(out)
    return total


def toolchain_paths() -> list[str]:
    """What a C build with cmake needs of this machine, as tar members
    relative to /: the files of the installed Debian packages cmake, make,
    gcc, libc6-dev, a shell's tools and the libraries libgit2 finds (those
    installed of OpenSSL, zlib, libssh2, PCRE2), and of everything they depend on
    (Depends and Pre-Depends, through Provides), their paths taken under
    the merged /usr (so /bin/sh is usr/bin/sh), the /etc/alternatives links
    to them (such as cc), and every directory above them, parents first."""
    status = sh(["dpkg-query", "-W", "-f=${Package}\t${db:Status-Status}\t${Provides}\t${Depends}, ${Pre-Depends}\n"])
    installed: dict[str, list[list[str]]] = {}
    provider: dict[str, str] = {}

    def names(field: str) -> list[str]:
        return [a.strip().split(" ")[0].split(":")[0] for a in field.split("|") if a.strip()]

    for line in status.stdout.decode().splitlines():
        pkg, st, provides, depends = line.split("\t")
        if st != "installed":
            continue
        installed[pkg] = [names(alt) for alt in depends.split(",") if alt.strip()]
        for v in provides.split(","):
            if v.strip():
                provider.setdefault(names(v)[0], pkg)
    seen: set[str] = set()
    # libgit2's cmake wants an HTTPS backend; the others it finds where they are.
    todo = ["cmake", "make", "gcc", "libc6-dev", "dash", "coreutils", "grep", "sed",
            "libssl-dev", "zlib1g-dev", "pkgconf", "libssh2-1-dev", "libpcre2-dev"]
    while todo:
        pkg = todo.pop()
        if pkg in seen or pkg not in installed:
            continue
        seen.add(pkg)
        for alts in installed[pkg]:
            # Of "a | b", the first alternative installed.
            found = [a if a in installed else provider.get(a) for a in alts]
            todo.extend([f for f in found if f][:1])
    listed = sh(["dpkg", "-L", *sorted(seen)]).stdout.decode().splitlines()
    files: set[str] = set()
    for path in listed:
        if path.startswith("/") and (os.path.islink(path) or os.path.isfile(path)):
            files.add(os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)))
    for d in ["/usr/bin", "/usr/sbin"]:
        for e in os.scandir(d):
            if e.is_symlink() and os.readlink(e.path).startswith("/etc/alternatives/"):
                if os.path.realpath(e.path) in files:
                    files.update([e.path, os.readlink(e.path)])
    dirs: set[str] = set()
    for f in files:
        parent = os.path.dirname(f)
        while parent != "/" and parent not in dirs:
            dirs.add(parent)
            parent = os.path.dirname(parent)
    return [p.lstrip("/") for p in sorted(dirs) + sorted(files)]


SNAP = {"tilefs": "tilefs", "reference": "overlayfs"}


class Engines:
    """Debian's docker-registry (with `names` of the layout pushed), the
    tilefs snapshotter and containerd, all under `dir`; their processes
    go to `procs`."""

    def __init__(self, b, dir: Path, procs: list, layout: Layout, names: list[str]):
        self.tilefs = b.tilefs
        (dir / "registry").mkdir(exist_ok=True)
        self.registry = Registry(dir / "registry")
        self.registry.start()
        procs.append(self.registry.proc)
        self.refs = {}
        for name in names:
            self.refs[name] = f"{self.registry.addr}/bench/{name}:v1"
            sh(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{layout.root}:{name}",
                f"docker://{self.refs[name]}"])
        log = open(dir / "daemons.log", "ab")
        self.store, self.snaproot, snap_sock = dir / "store", dir / "snaproot", dir / "s.sock"
        procs.append(subprocess.Popen([self.tilefs, "snapshotter", "--root", self.snaproot, "--store", self.store,
                                       "--socket", snap_sock], stdout=log, stderr=log))
        wait_for(snap_sock.exists, "the snapshotter")
        sock = dir / "c.sock"
        self.croot = dir / "croot"
        config = dir / "containerd.toml"
        config.write_text(
            f'version = 2\nroot = "{self.croot}"\nstate = "{dir / "cstate"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n'
            f'[proxy_plugins]\n  [proxy_plugins.tilefs]\n    type = "snapshot"\n    address = "{snap_sock}"\n')
        procs.append(subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=log))
        self.ctr = ["ctr", "--address", sock, "--namespace", NAMESPACE]
        wait_for(lambda: subprocess.run([str(a) for a in self.ctr + ["version"]], capture_output=True).returncode == 0,
                 "containerd")

    def remove_images(self, role: str | None = None) -> None:
        for ref in self.refs.values():
            subprocess.run([str(a) for a in self.ctr + ["images", "rm", "--sync", ref]], capture_output=True)
        if role in (None, "tilefs"):
            subprocess.run([self.tilefs, "gc", "--store", str(self.store)], capture_output=True)
        # The removals' writeback is not left to the timed run.
        os.sync()

    def pull_argv(self, role: str, name: str = "a") -> list:
        return self.ctr + ["images", "pull", "--plain-http", "--snapshotter", SNAP[role], self.refs[name]]


def stop(procs: list) -> None:
    for p in reversed(procs):
        terminate(p)
    procs.clear()


def run(b) -> None:
    tools = {t: shutil.which(t) for t in ["containerd", "ctr", "runc", "docker-registry", "skopeo", "tar"]}
    missing = [t for t, p in tools.items() if not p]
    if os.geteuid() != 0 or missing or not Path("/bin/busybox").exists():
        why = "needs root" if os.geteuid() != 0 else f"missing: {', '.join(missing) or 'busybox-static'}"
        b.skip("containerd/pull", "containerd pull + unpack", why + " (scripts/setup installs the tools)")
        return
    tree = Path(os.environ.get("BENCH_TREE") or "/usr/share")
    work = b.tmpdir(NAME)
    procs = []
    try:
        _run(b, work, tree, procs)
    finally:
        stop(procs)
        unmount_below(work)
        remove_cgroup(NAMESPACE)


def _run(b, work: Path, tree: Path, procs: list) -> None:
    # The images.
    b.progress(f"making the images from {tree}")
    top = sorted(p.name for p in tree.iterdir())
    groups = [top[i::3] for i in range(3)]
    rel = tree.relative_to("/")
    layout = Layout(work / "layout")
    bb = work / "bb"
    (bb / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", bb / "bin" / "busybox")
    for app in ["sh", "ls", "echo", "true"]:
        if not (bb / "bin" / app).exists():
            os.symlink("busybox", bb / "bin" / app)
    a_layers, b_layers = [], []
    for i, g in enumerate(groups):
        members = [str(rel / n) for n in g]
        a_layers.append(layout.layer_from(["tar", "-C", "/", "-cf", "-", "--numeric-owner", *members]))
        b_layers.append(layout.layer_from(["tar", "-C", "/", "-cf", "-", "--numeric-owner", "--mtime=@1", *members]))
    busybox = layout.layer_from(["tar", "-C", bb, "-cf", "-", "--numeric-owner", "bin"])
    total = sum(int(x) for x in sh(["du", "-sxB1", "--apparent-size", tree]).stdout.split()[:1])
    extra = work / "extra"
    (extra / "new").mkdir(parents=True, exist_ok=True)
    left, n = total // 10, 0
    while left > 0:
        size = min(left, 1 << 20)
        (extra / "new" / f"f{n}").write_bytes(os.urandom(size))
        left -= size
        n += 1
    layout.image("a", [*a_layers, busybox], CONFIG)
    layout.image("b", [*b_layers, layout.layer_from(["tar", "-C", extra, "-cf", "-", "new"]), busybox], CONFIG)
    shutil.rmtree(extra)
    names = ["a", "b"]
    crate, how = writable.find_crate(b)
    if crate is None:
        b.skip("containerd/build", "libgit2 build in a container", how)
    else:
        b.progress("making the C build image (this machine's toolchain, libgit2's sources)")
        base = work / "base"
        base.mkdir()
        for d in ["bin", "lib", "lib64", "sbin"]:
            os.symlink(f"usr/{d}", base / d)
        (base / "tmp").mkdir()
        os.chmod(base / "tmp", 0o1777)
        members = work / "toolchain.list"
        members.write_text("\n".join(toolchain_paths()) + "\n")
        unpack = work / "unpack"
        unpack.mkdir()
        sh(["tar", "-xzf", crate, "-C", unpack])
        layout.image("c", [
            layout.layer_from(["tar", "-C", base, "-cf", "-", "--numeric-owner", "bin", "lib", "lib64", "sbin", "tmp"]),
            layout.layer_from(["tar", "-C", "/", "-cf", "-", "--numeric-owner", "--no-recursion", "-T", members]),
            layout.layer_from(["tar", "-C", unpack / writable.CRATE, "-cf", "-", "--numeric-owner", "libgit2"]),
        ], CONFIG)
        shutil.rmtree(unpack)
        names.append("c")

    # The registry, the snapshotter and containerd: on the disk, and for the
    # pull once more on a tmpfs, where the device's erratic speed (it
    # varies run to run by more than the snapshotters differ) is left out.
    eng = Engines(b, work, procs, layout, names)
    if os.environ.get("BENCH_CONTAINERD_TMPFS", "1") != "0":
        mem = work / "tmpfs"
        mem.mkdir()
        sh(["mount", "-t", "tmpfs", "-o", "size=12g,mode=0700", "tmpfs", mem])
        mem_procs: list = []
        try:
            m = Engines(b, mem, mem_procs, layout, ["a"])
            b.compare(
                "containerd/pull-tmpfs",
                f"ctr image pull + unpack of {tree} in 3 layers (+busybox), everything on a tmpfs",
                m.pull_argv("tilefs"),
                m.pull_argv("reference"),
                ref_tool="containerd overlayfs",
                prepare=m.remove_images,
                nbytes=total,
                notes=["containerd's root, the snapshotter's root, the store and the registry on one tmpfs: "
                       "what the snapshotters cost without the device"],
            )
        finally:
            stop(mem_procs)
            unmount_below(mem)
    shutil.rmtree(layout.root)
    ctr, refs, store, snaproot, croot = eng.ctr, eng.refs, eng.store, eng.snaproot, eng.croot
    remove_images, pull_argv = eng.remove_images, eng.pull_argv

    b.compare(
        "containerd/pull",
        f"ctr image pull + unpack of {tree} in 3 layers (+busybox), from a registry on loopback",
        pull_argv("tilefs"),
        pull_argv("reference"),
        ref_tool="containerd overlayfs",
        prepare=remove_images,
        goal=PULL_GOAL,
        nbytes=total,
        notes=["containerd's content store and both snapshotters emptied before every run (gc --sync; tilefs gc)"],
    )

    # Both images, with each snapshotter: disk used.
    remove_images()
    for role in ["tilefs", "reference"]:
        for name in ["a", "b"]:
            sh(pull_argv(role, name))
    # The disk is measured once the snapshotter holds one image per
    # committed snapshot: in STORE/.owned/HOLDER/ (older tilefs: tags
    # snapshotter-* in STORE/images/, so that a binary from before can be
    # measured too).
    def settled() -> bool:
        out = sh(ctr + ["snapshots", "--snapshotter", "tilefs", "ls"]).stdout.decode()
        committed = sum(1 for l in out.splitlines()[1:] if l.split()[-1:] == ["Committed"])
        images = store / "images"
        tags = sum(1 for p in images.iterdir() if p.name.startswith("snapshotter-")) if images.exists() else 0
        owned = store / ".owned"
        if owned.exists():
            tags += sum(1 for h in owned.iterdir() if h.is_dir()
                        for p in h.iterdir() if not p.name.startswith("."))
        return tags == committed

    wait_for(settled, "the snapshotter's layers", timeout=300)
    ovl = croot / "io.containerd.snapshotter.v1.overlayfs"
    t_disk, r_disk = du(store, snaproot), du(ovl)
    ratio = t_disk / r_disk if r_disk else float("nan")
    b.info(
        "containerd/disk",
        "disk used by two images sharing 90% of their files (tilefs store + snapshotter state / overlayfs snapshots)",
        f"{t_disk / 1e6:.0f} MB / {r_disk / 1e6:.0f} MB = {ratio:.2f} (goal <= {DISK_GOAL})",
        {"tilefs_bytes": t_disk, "overlayfs_bytes": r_disk, "ratio": ratio, "goal": DISK_GOAL,
         "goal_met": ratio <= DISK_GOAL},
    )

    def run_argv(role: str, cmd: list, name: str = "a") -> list:
        return ctr + ["run", "--rm", "--snapshotter", SNAP[role], refs[name], f"bench-{role}", *cmd]

    b.compare(
        "containerd/run",
        "ctr run to a container's first output (busybox echo)",
        run_argv("tilefs", ["/bin/echo", "hi"]),
        run_argv("reference", ["/bin/echo", "hi"]),
        ref_tool="containerd overlayfs",
        goal=RUN_GOAL,
        same_stdout=lambda x, y: x == y,
    )
    b.compare(
        "containerd/ls",
        f"ls -lR /{rel} in a container (warm)",
        run_argv("tilefs", ["/bin/sh", "-c", f"ls -lR /{rel} > /dev/null"]),
        run_argv("reference", ["/bin/sh", "-c", f"ls -lR /{rel} > /dev/null"]),
        ref_tool="containerd overlayfs",
        goal=LS_GOAL,
    )
    if "c" in refs:
        for role in ["tilefs", "reference"]:
            sh(pull_argv(role, "c"))
        build = (f"cmake -S /libgit2 -B /build {' '.join(writable.CMAKE_ARGS)} > /dev/null"
                 f" && make -C /build -j{writable.JOBS} > /dev/null && ls /build | grep -c '^libgit2\\.so'")
        b.compare(
            "containerd/build",
            f"libgit2 build (cmake configure + make -j{writable.JOBS}) in a container (warm)",
            run_argv("tilefs", ["/bin/sh", "-c", build], "c"),
            run_argv("reference", ["/bin/sh", "-c", build], "c"),
            ref_tool="containerd overlayfs",
            goal=BUILD_GOAL,
            # The build's libgit2.so files (the library, its links), counted.
            same_stdout=lambda x, y: x == y and x.strip() not in (b"", b"0"),
            notes=[f"sources: {how}; the build directory (/build) is in the container's upper directory"],
        )
    remove_images()
