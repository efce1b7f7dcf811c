"""Section vm: a VM's filesystem served by tilefs over virtio-fs against QEMU's 9p and virtiofsd.

Each run boots Debian's kernel (linux-image-amd64) under QEMU, once per
configuration and workload, interleaved (order rotated every run); the
guest times its own workloads (/proc/uptime around them: 10 ms steps) and
prints them on the serial console:
  - tilefs: `tilefs serve --vhost-user` of a writable image of the tree
    (`vhost-user-fs-pci`, shared memfd memory),
  - 9p: the tree itself through QEMU's virtio-9p (`trans=virtio,
    version=9p2000.L,cache=loose,msize=512000`),
  - virtiofsd: crates.io's virtiofsd (`--cache=always`) serving the tree
    itself (an unpacked copy of what the image holds), when it is on PATH
    or in $VIRTIOFSD. To get it: `apt-get install libseccomp-dev
    libcap-ng-dev && cargo install virtiofsd` (no test needs it, so
    scripts/setup does not install it).
Workloads:
  - on a busybox initramfs, each on a fresh mount (the guest's caches
    cold; the host's warm after the first boot): `stat` of 1000 random
    entries, `ls -lR` of the tree, then `ls -lR` again (warm);
  - a C build with the shared filesystem as the guest's root (switched
    to from the initramfs, as `root=TAG rootfstype=virtiofs` would): a
    root holding Debian's gcc, binutils, make and libc headers (the files
    of those installed packages and what they depend on) and a generated
    project of BENCH_VM_CFILES C files, each including a dozen system
    headers, built with `make -j2` at -O1. Writes go to the upper
    directory (tilefs) or the tree (9p, virtiofsd; the build output is
    removed after each run). The same build natively on the host is
    reported beside it. Not libgit2 as the issue has it: under TCG its
    build takes tens of minutes a run.

The tree is generated (BENCH_VM_DIRS x BENCH_VM_FILES files, small, with
symlinks). KVM is used when /dev/kvm boots a guest, else TCG; the rows say
which. Other builds running on the machine make the numbers noisy: the
results record the load average.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import lib

NAME = "vm"
TITLE = "VM (QEMU, Debian's kernel): tilefs over virtio-fs vs 9p cache=loose: stat, ls -lR"
ORDER = 60

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /mnt
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /lib/modules/$m 2>/dev/null; done
case "$(cat /proc/cmdline)" in
  *bench=9p*) fs() { mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=512000,ro src9p /mnt; } ;;
  *) fs() { mount -t virtiofs tilefs /mnt; } ;;
esac
now() { cut -d" " -f1 /proc/uptime | tr -d .; }
fs || echo "BENCH mount-failed"
cd /mnt; t0=$(now); xargs stat < /stat.list > /dev/null; t1=$(now); cd /
echo "BENCH stat $(( (t1 - t0) * 10000 ))"
umount /mnt; fs
t0=$(now); ls -lR /mnt > /dev/null; t1=$(now)
echo "BENCH lsR $(( (t1 - t0) * 10000 ))"
t0=$(now); ls -lR /mnt > /dev/null; t1=$(now)
echo "BENCH lsR-warm $(( (t1 - t0) * 10000 ))"
umount /mnt
echo "BENCH done"
poweroff -f
"""

WORKLOADS = [
    ("stat", "stat of 1000 random entries, cold guest cache", True),
    ("lsR", "ls -lR of the tree, cold guest cache", True),
    ("lsR-warm", "ls -lR of the tree, warm", False),
]

# The initramfs of the build boots: the shared filesystem mounted and
# switched to as the root, its /bench-init run as pid 1.
BUILD_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /root
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /lib/modules/$m 2>/dev/null; done
case "$(cat /proc/cmdline)" in
  *bench=9p*) mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=512000 src9p /root ;;
  *) mount -t virtiofs tilefs /root ;;
esac || echo "BENCH mount-failed"
umount /proc /sys
mount --move /dev /root/dev
exec switch_root /root /bench-init
"""

# The build root's init: times the build, checks its result.
BENCH_INIT = r"""#!/bin/sh
export PATH=/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin
busybox mount -t proc proc /proc
now() { busybox cut -d" " -f1 /proc/uptime | busybox tr -d .; }
t0=$(now)
make -s -C /build/proj -j2 OUT=/build/out > /make.log 2>&1 || echo "BENCH build-failed $(busybox tail -n 5 /make.log | busybox tr '\n' ' ')"
t1=$(now)
[ -x /build/out/prog ] && [ "$(/build/out/prog)" = "$(busybox cat /build/proj/expected)" ] && echo "BENCH build $(( (t1 - t0) * 10000 ))"
busybox sync
echo "BENCH done"
busybox poweroff -f
"""

# The packages whose files (and their dependencies') make the build root.
TOOLCHAIN = ["gcc", "make", "libc6-dev"]
# Not needed to compile and large: left out of the build root.
SKIP_PREFIXES = ("/usr/share/doc", "/usr/share/man", "/usr/share/info", "/usr/share/locale", "/usr/share/lintian")
HEADERS = ["stdio.h", "stdlib.h", "string.h", "math.h", "pthread.h", "unistd.h", "errno.h", "time.h", "ctype.h",
           "sys/stat.h", "sys/types.h", "fcntl.h", "signal.h", "stdint.h", "limits.h", "assert.h"]


def toolchain_packages() -> list[str]:
    out = subprocess.run(["apt-cache", "depends", "--recurse", "--installed", "--no-recommends", "--no-suggests",
                          "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", *TOOLCHAIN],
                         capture_output=True, text=True, check=True).stdout
    names = {line.strip() for line in out.splitlines() if line and not line.startswith((" ", "<"))}
    installed = subprocess.run(["dpkg-query", "-W", "-f", "${Package}:${Status}\n", *sorted(names)],
                               capture_output=True, text=True).stdout
    return sorted(n.split(":")[0] for n in installed.splitlines() if n.endswith("install ok installed"))


def copy_path(src: str, root: Path) -> None:
    """Copies the host's file, symlink or directory `src` to the same place under `root`
    (its directory resolved as on the host: /lib is /usr/lib under merged /usr)."""
    if src.startswith(SKIP_PREFIXES) or not os.path.lexists(src):
        return
    parent = os.path.realpath(os.path.dirname(src))
    dst = root / (parent.lstrip("/")) / os.path.basename(src)
    if os.path.islink(src):
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(dst):
            os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        dst.mkdir(parents=True, exist_ok=True)
    elif os.path.isfile(src):
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            shutil.copy2(src, dst)


def make_build_root(root: Path, busybox: str, cfiles: int) -> int:
    """The build root: the toolchain's files, busybox for the rest, the project. Returns its file count."""
    root.mkdir(parents=True)
    for top in ("bin", "sbin", "lib", "lib64"):
        h = Path("/") / top
        if h.is_symlink():
            (root / top).symlink_to(os.readlink(h))
    for d in ("proc", "sys", "dev", "tmp", "usr/local/bin", "build"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for pkg in toolchain_packages():
        listed = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True).stdout
        for f in listed.splitlines():
            if f.startswith("/"):
                copy_path(f, root)
    usr_bin = root / "usr/bin"
    usr_bin.mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, usr_bin / "busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True).stdout.split()
    for a in applets:
        if not (usr_bin / a).exists() and not (root / "usr/sbin" / a).exists():
            (root / "usr/local/bin" / a).symlink_to("/usr/bin/busybox")
    if not (usr_bin / "sh").exists():
        (usr_bin / "sh").symlink_to("busybox")
    (root / "bench-init").write_text(BENCH_INIT)
    (root / "bench-init").chmod(0o755)
    make_project(root / "build/proj", cfiles)
    return sum(len(f) for _, _, f in os.walk(root))


def make_project(proj: Path, n: int) -> None:
    """`n` C files, each including HEADERS and the project's header, with a few
    functions of loops and arithmetic; a main that calls them; a Makefile."""
    proj.mkdir(parents=True)
    (proj / "common.h").write_text("".join(f"int f{i}(int x);\n" for i in range(n)))
    rng = random.Random(7)
    expect = 0
    for i in range(n):
        body = [f"#include <{h}>" for h in HEADERS] + ['#include "common.h"']
        consts = [rng.randrange(1, 1000) for _ in range(32)]
        body.append(f"static const int k{i}[32] = {{{', '.join(map(str, consts))}}};")
        for j in range(8):
            body.append(f"static int g{j}(int x) {{ int s = 0; for (int i = 0; i < 32; i++) s += (x ^ k{i}[i]) * {j + 1} % 97; "
                        f"return s + (int)strlen(\"{'x' * j}\"); }}")
        body.append(f"int f{i}(int x) {{ return " + " + ".join(f"g{j}(x + {j})" for j in range(8)) + "; }")
        (proj / f"f{i}.c").write_text("\n".join(body) + "\n")
        x = 3
        for j in range(8):
            expect += sum((x + j ^ c) * (j + 1) % 97 for c in consts) + j
    calls = " ".join(f"s += f{i}(3);" for i in range(n))
    (proj / "main.c").write_text(f'#include <stdio.h>\n#include "common.h"\nint main(void) {{ long s = 0; {calls} '
                                 f'printf("%ld\\n", s); return 0; }}\n')
    (proj / "expected").write_text(f"{expect}\n")
    (proj / "Makefile").write_text(
        "OUT ?= out\nSRCS := $(wildcard *.c)\nOBJS := $(SRCS:%.c=$(OUT)/%.o)\n"
        "$(OUT)/prog: $(OBJS)\n\tgcc -o $@ $(OBJS) -lm -lpthread\n"
        "$(OUT)/%.o: %.c common.h | $(OUT)\n\tgcc -O1 -c -o $@ $<\n"
        "$(OUT):\n\tmkdir -p $@\n")


def kernel() -> tuple[Path, Path] | None:
    ks = sorted(Path("/boot").glob("vmlinuz-*"))
    if not ks:
        return None
    k = ks[-1]
    mods = Path("/lib/modules") / k.name[len("vmlinuz-"):]
    return (k, mods) if (mods / "modules.dep").exists() else None


def modules(moddir: Path, wanted: list[str]) -> list[Path]:
    deps = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        m, _, d = line.partition(":")
        deps[m] = d.split()
    order: list[str] = []
    for w in wanted:
        m = next(k for k in deps if Path(k).name == f"{w}.ko")
        for d in list(reversed(deps[m])) + [m]:
            if d not in order:
                order.append(d)
    return [moddir / m for m in order]


def cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
        out.extend(b"070701" + "".join(f"{x:08x}" for x in fields).encode())
        out.extend(name.encode() + b"\0")
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    for i, (n, m, d) in enumerate(entries):
        put(n, m, d, i + 1)
    put("TRAILER!!!", 0, b"", 0)
    return bytes(out)


def make_tree(root: Path, dirs: int, files: int, rng: random.Random) -> list[str]:
    paths = []
    for d in range(dirs):
        sub = root / f"d{d:03}" / f"s{d % 7}"
        sub.mkdir(parents=True)
        for f in range(files):
            p = sub / f"f{f:04}.c"
            p.write_bytes(os.urandom(rng.choice([100, 900, 3000, 9000, 30000])))
            paths.append(str(p.relative_to(root)))
        (sub / "link").symlink_to(f"f{0:04}.c")
        paths.append(str((sub / "link").relative_to(root)))
    return paths


def boot(b, cmd: list[str], console: Path, timeout: float, keys: list[str]) -> dict[str, float] | str:
    console.unlink(missing_ok=True)
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "timed out"
    text = console.read_text(errors="replace") if console.exists() else ""
    got = {}
    for line in text.splitlines():
        parts = line.strip().split()
        if len(parts) == 3 and parts[0] == "BENCH" and parts[2].isdigit():
            got[parts[1]] = int(parts[2]) / 1e6
    if "BENCH done" not in text or any(k not in got for k in keys):
        err = (p.stderr.read() or b"").decode(errors="replace")[-300:]
        return f"guest failed: {text[-400:]} {err}"
    return got


def initramfs(path: Path, init: str, busybox: str, mods: list[Path], extra: list[tuple[str, int, bytes]]) -> Path:
    entries = [("bin", 0o040755, b""), ("lib", 0o040755, b""), ("lib/modules", 0o040755, b""),
               ("tmp", 0o041777, b""), ("bin/busybox", 0o100755, Path(busybox).read_bytes()),
               ("init", 0o100755, init.encode())] + extra
    for m in mods:
        entries.append((f"lib/modules/{m.name}", 0o100644, m.read_bytes()))
    entries.append(("modules", 0o100644, " ".join(m.name for m in mods).encode()))
    path.write_bytes(cpio(entries))
    return path


def virtiofsd_path() -> str | None:
    return os.environ.get("VIRTIOFSD") or shutil.which("virtiofsd") or next(
        (str(p) for p in [Path.home() / ".cargo/bin/virtiofsd", Path("/usr/libexec/virtiofsd")] if p.is_file()), None)


def run(b) -> None:
    qemu = shutil.which("qemu-system-x86_64")
    kv = kernel()
    busybox = next((p for p in ["/bin/busybox", "/usr/bin/busybox"] if Path(p).is_file()), None)
    if not (qemu and kv and busybox):
        b.skip("vm", TITLE, "needs qemu-system-x86, linux-image-amd64 and busybox-static (scripts/setup)")
        return
    kpath, moddir = kv
    runs = lib.env_int("BENCH_VM_RUNS", 3)
    virtiofsd = virtiofsd_path()
    work = b.tmpdir(NAME)
    rng = random.Random(30)
    src = work / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir()
    paths = make_tree(src, lib.env_int("BENCH_VM_DIRS", 40), lib.env_int("BENCH_VM_FILES", 150), rng)
    entries_n = len(paths)
    store, image = work / "store", work / "image.cfs"
    shutil.rmtree(store, ignore_errors=True)
    subprocess.run([b.tilefs, "build", "--quiet", "--store", store, src, image], check=True)
    b.progress("vm: making the build root (gcc, make, libc headers) ...", final=False)
    broot = work / "broot"
    shutil.rmtree(broot, ignore_errors=True)
    cfiles = lib.env_int("BENCH_VM_CFILES", 24)
    broot_files = make_build_root(broot, busybox, cfiles)
    bimage = work / "broot.cfs"
    subprocess.run([b.tilefs, "build", "--quiet", "--store", store, broot, bimage], check=True)
    mods = modules(moddir, ["virtio_pci", "virtiofs", "9pnet_virtio", "9p"])
    stat_list = "\n".join(rng.sample(paths, min(1000, len(paths)))) + "\n"
    initrd = initramfs(work / "initramfs.cpio", INIT, busybox, mods, [("stat.list", 0o100644, stat_list.encode())])
    build_initrd = initramfs(work / "build-initramfs.cpio", BUILD_INIT, busybox, mods, [])

    accel = "kvm" if os.access("/dev/kvm", os.R_OK | os.W_OK) else "tcg"
    sock = work / "fs.sock"
    upper, wdir = work / "upper", work / "work"
    base = [qemu, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-smp", "2", "-m", "1G",
            "-object", "memory-backend-memfd,id=mem,size=1G,share=on", "-numa", "node,memdev=mem",
            "-kernel", str(kpath)]

    def qemu_cmd(config: str, console: Path, tree: Path, build: bool) -> list[str]:
        cmd = base + ["-initrd", str(build_initrd if build else initrd),
                      "-machine", f"q35,accel={accel}", "-cpu", "max", "-serial", f"file:{console}",
                      "-append", f"console=ttyS0 quiet loglevel=3 panic=-1 bench={config}"]
        if config == "9p":
            ro = "" if build else ",readonly=on"
            cmd += ["-fsdev", f"local,id=fs9,path={tree},security_model=none{ro}",
                    "-device", "virtio-9p-pci,fsdev=fs9,mount_tag=src9p"]
        else:
            cmd += ["-chardev", f"socket,id=fs0,path={sock}", "-device", "vhost-user-fs-pci,chardev=fs0,tag=tilefs"]
        return [str(x) for x in cmd]

    def served(argv: list[str], console: Path, cmd: list[str], timeout: float, keys: list[str]):
        sock.unlink(missing_ok=True)
        srv = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=open(work / "server.log", "ab"))
        try:
            end = time.monotonic() + 20
            while not sock.exists() and time.monotonic() < end and srv.poll() is None:
                time.sleep(0.05)
            return boot(b, cmd, console, timeout, keys)
        finally:
            srv.kill()
            srv.wait()

    def once(config: str, build: bool) -> dict[str, float] | str:
        console = work / f"console-{config}{'-build' if build else ''}.log"
        keys = ["build"] if build else [k for k, _, _ in WORKLOADS]
        timeout = 1800 if build else 600
        tree, img = (broot, bimage) if build else (src, image)
        if build:
            shutil.rmtree(broot / "build/out", ignore_errors=True)
            (broot / "make.log").unlink(missing_ok=True)
        cmd = qemu_cmd(config, console, tree, build)
        if config == "tilefs":
            for d in (upper, wdir):
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir()
            return served([b.tilefs, "serve", "--vhost-user", str(sock), "--store", str(store), "--upper",
                           str(upper), "--work", str(wdir), "--once", str(img)], console, cmd, timeout, keys)
        if config == "virtiofsd":
            return served([virtiofsd, "--socket-path", str(sock), "--shared-dir", str(tree), "--cache", "always",
                           "--sandbox", "none"], console, cmd, timeout, keys)
        return boot(b, cmd, console, timeout, keys)

    def native() -> float:
        out = work / "native-out"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.monotonic()
        subprocess.run(["make", "-s", "-C", str(broot / "build/proj"), "-j2", f"OUT={out}"], check=True,
                       stdout=subprocess.DEVNULL)
        return time.monotonic() - t0

    configs = ["tilefs", "9p"] + (["virtiofsd"] if virtiofsd else [])
    results: dict[str, dict[str, list[float]]] = {c: {} for c in configs + ["native"]}
    errors: dict[str, str] = {}
    for i in range(runs):
        order = configs[i % len(configs):] + configs[:i % len(configs)]
        for build in (False, True):
            for c in order:
                what = "build" if build else "stat, ls -lR"
                b.progress(f"vm: run {i + 1}/{runs}, {c}: {what} ({accel}) ...", final=False)
                if b.can_drop_caches():
                    b.drop_caches()
                got = once(c, build)
                if isinstance(got, str) and accel == "kvm" and i == 0:
                    # /dev/kvm that does not run guests: TCG from here on.
                    accel = "tcg"
                    got = once(c, build)
                if isinstance(got, str):
                    errors[f"{c}{'-build' if build else ''}"] = got
                    continue
                for k, v in got.items():
                    results[c].setdefault(k, []).append(v)
        if b.can_drop_caches():
            b.drop_caches()
        results["native"].setdefault("build", []).append(native())

    def series(tool: str, c: str, k: str, build: bool) -> lib.Series:
        argv = ["make", "-j2"] if c == "native" else qemu_cmd(c, Path("console.log"), broot if build else src, build)
        s = lib.Series(tool=tool, argv=argv)
        vals = results[c].get(k, [])
        s.samples = [lib.Sample(wall=v, user=0.0, sys=0.0, maxrss_kib=0, rc=0) for v in vals]
        if not vals:
            s.error = errors.get(f"{c}{'-build' if build else ''}", "no samples")
        return s

    guest = f"timed in the guest; QEMU {accel}, 2 vCPUs, 1 GiB, Debian kernel {kpath.name}"
    refs = [("9p", "9p cache=loose", 0.7)] + ([("virtiofsd", "virtiofsd --cache=always", 1.0)] if virtiofsd else [])
    for ref, ref_tool, goal in refs:
        for k, title, cold in WORKLOADS:
            row = lib.Row(b.section, f"{k}-vs-{ref}", f"{title} ({entries_n} entries; {accel})",
                          tilefs=series("tilefs", "tilefs", k, False), ref=series(ref, ref, k, False),
                          ref_tool=ref_tool, goal=goal, cold=cold)
            row.notes.append(guest)
            b.rows.append(row)
        build_title = (f"C build in the guest, its root the shared filesystem ({cfiles} files x {len(HEADERS)} "
                       f"system headers, gcc -O1, make -j2; a root of {broot_files} files; {accel})")
        row = lib.Row(b.section, f"build-vs-{ref}", build_title, tilefs=series("tilefs", "tilefs", "build", True),
                      ref=series(ref, ref, "build", True), ref_tool=ref_tool, goal=goal, cold=True)
        row.notes.append(guest + "; the build's output checked (the program runs and prints the expected sum)")
        b.rows.append(row)
    row = lib.Row(b.section, "build-vs-native", f"the same build: tilefs in the guest ({accel}) vs natively on the host",
                  tilefs=series("tilefs", "tilefs", "build", True), ref=series("native", "native", "build", True),
                  ref_tool="native (host, ext4/overlay, make -j2)", cold=True)
    row.notes.append("not a like-for-like ratio under TCG: the guest's CPU is emulated")
    b.rows.append(row)
    for row in b.rows:
        if row.section == b.section and row.kind == "compare":
            r = row.ratio()
            b.progress(f"{row.title}: tilefs {row.tilefs.median() if row.tilefs.ok else 'FAILED'} s, "
                       f"{row.ref_tool} {row.ref.median() if row.ref.ok else 'FAILED'} s, ratio {r and round(r, 2)}")
    if not virtiofsd:
        b.skip("virtiofsd", "the same against virtiofsd --cache=always",
               "virtiofsd not found (VIRTIOFSD, PATH, ~/.cargo/bin): apt-get install libseccomp-dev libcap-ng-dev "
               "&& cargo install virtiofsd")
