"""Section vm: a VM's filesystem served by tilefs over virtio-fs against QEMU's 9p.

Each run boots Debian's kernel (linux-image-amd64) under QEMU with a busybox
initramfs made here, once per configuration, interleaved (order rotated
every run); the guest times its own workloads (/proc/uptime around them: 10 ms steps) and
prints them on the serial console:
  - tilefs: `tilefs serve --vhost-user` of a writable image of the tree
    (`vhost-user-fs-pci`, shared memfd memory),
  - 9p: the tree itself through QEMU's virtio-9p (`trans=virtio,
    version=9p2000.L,cache=loose,msize=512000`, read-only export).
Workloads, each on a fresh mount (the guest's caches cold; the host's warm
after the first boot): `stat` of 1000 random entries, `ls -lR` of the tree,
then `ls -lR` again (warm).

The tree is generated (BENCH_VM_DIRS x BENCH_VM_FILES files, small, with
symlinks). Not yet measured here: the libgit2 build the issue asks for
(the busybox guest has no compiler; a Debian guest root is needed) and
crates.io's virtiofsd (not installed: a row says so). KVM is used when
/dev/kvm boots a guest, else TCG; the rows say which.
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


def boot(b, cmd: list[str], console: Path, timeout: float) -> dict[str, float] | str:
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
        if len(parts) == 3 and parts[0] == "BENCH":
            got[parts[1]] = int(parts[2]) / 1e6
    if "done" not in text or len(got) < len(WORKLOADS):
        err = (p.stderr.read() or b"").decode(errors="replace")[-300:]
        return f"guest failed: {text[-300:]} {err}"
    return got


def run(b) -> None:
    qemu = shutil.which("qemu-system-x86_64")
    kv = kernel()
    busybox = next((p for p in ["/bin/busybox", "/usr/bin/busybox"] if Path(p).is_file()), None)
    if not (qemu and kv and busybox):
        b.skip("vm", TITLE, "needs qemu-system-x86, linux-image-amd64 and busybox-static (scripts/setup)")
        return
    kpath, moddir = kv
    runs = lib.env_int("BENCH_VM_RUNS", 3)
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
    mods = modules(moddir, ["virtio_pci", "virtiofs", "9pnet_virtio", "9p"])
    stat_list = "\n".join(rng.sample(paths, min(1000, len(paths)))) + "\n"
    entries = [("bin", 0o040755, b""), ("lib", 0o040755, b""), ("lib/modules", 0o040755, b""),
               ("tmp", 0o041777, b""), ("bin/busybox", 0o100755, Path(busybox).read_bytes()),
               ("init", 0o100755, INIT.encode()), ("stat.list", 0o100644, stat_list.encode())]
    for m in mods:
        entries.append((f"lib/modules/{m.name}", 0o100644, m.read_bytes()))
    entries.append(("modules", 0o100644, " ".join(m.name for m in mods).encode()))
    initrd = work / "initramfs.cpio"
    initrd.write_bytes(cpio(entries))

    accel = "kvm" if os.access("/dev/kvm", os.R_OK | os.W_OK) else "tcg"
    sock = work / "fs.sock"
    upper, wdir = work / "upper", work / "work"
    base = [qemu, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-smp", "2", "-m", "1G",
            "-object", "memory-backend-memfd,id=mem,size=1G,share=on", "-numa", "node,memdev=mem",
            "-kernel", str(kpath), "-initrd", str(initrd)]

    def qemu_cmd(config: str, console: Path) -> list[str]:
        cmd = base + ["-machine", f"q35,accel={accel}", "-cpu", "max", "-serial", f"file:{console}",
                      "-append", f"console=ttyS0 quiet loglevel=3 panic=-1 bench={config}"]
        if config == "tilefs":
            cmd += ["-chardev", f"socket,id=fs0,path={sock}", "-device", "vhost-user-fs-pci,chardev=fs0,tag=tilefs"]
        else:
            cmd += ["-fsdev", f"local,id=fs9,path={src},security_model=none,readonly=on",
                    "-device", "virtio-9p-pci,fsdev=fs9,mount_tag=src9p"]
        return [str(x) for x in cmd]

    def tilefs_once(console: Path) -> dict[str, float] | str:
        for d in (upper, wdir):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        sock.unlink(missing_ok=True)
        srv = subprocess.Popen([b.tilefs, "serve", "--vhost-user", str(sock), "--store", str(store), "--upper",
                                str(upper), "--work", str(wdir), "--once", "--log", str(work / "server.log"),
                                str(image)], stdin=subprocess.DEVNULL)
        try:
            end = time.monotonic() + 20
            while not sock.exists() and time.monotonic() < end and srv.poll() is None:
                time.sleep(0.05)
            return boot(b, qemu_cmd("tilefs", console), console, 600)
        finally:
            srv.kill()
            srv.wait()

    results: dict[str, dict[str, list[float]]] = {"tilefs": {}, "9p": {}}
    errors: dict[str, str] = {}
    configs = ["tilefs", "9p"]
    for i in range(runs):
        order = configs[i % 2:] + configs[:i % 2]
        for c in order:
            b.progress(f"vm: run {i + 1}/{runs}, {c} ({accel}) ...", final=False)
            if b.can_drop_caches():
                b.drop_caches()
            console = work / f"console-{c}.log"
            got = tilefs_once(console) if c == "tilefs" else boot(b, qemu_cmd("9p", console), console, 600)
            if isinstance(got, str):
                if accel == "kvm" and i == 0:
                    # /dev/kvm that does not run guests: TCG from here on.
                    accel = "tcg"
                    got = tilefs_once(console) if c == "tilefs" else boot(b, qemu_cmd("9p", console), console, 600)
                if isinstance(got, str):
                    errors[c] = got
                    continue
            for k, v in got.items():
                results[c].setdefault(k, []).append(v)

    def series(tool: str, c: str, k: str) -> lib.Series:
        s = lib.Series(tool=tool, argv=qemu_cmd(c, Path("console.log")))
        vals = results[c].get(k, [])
        s.samples = [lib.Sample(wall=v, user=0.0, sys=0.0, maxrss_kib=0, rc=0) for v in vals]
        if not vals:
            s.error = errors.get(c, "no samples")
        return s

    for k, title, cold in WORKLOADS:
        row = lib.Row(b.section, k, f"{title} ({entries_n} entries; {accel})", tilefs=series("tilefs", "tilefs", k),
                      ref=series("9p", "9p", k), ref_tool="9p cache=loose", goal=0.7, cold=cold)
        row.notes.append(f"timed in the guest; QEMU {accel}, 2 vCPUs, 1 GiB, Debian kernel {kpath.name}")
        b.rows.append(row)
        r = row.ratio()
        b.progress(f"{row.title}: tilefs {row.tilefs.median() if row.tilefs.ok else 'FAILED'} s, "
                   f"9p {row.ref.median() if row.ref.ok else 'FAILED'} s, ratio {r and round(r, 2)}")
    b.skip("virtiofsd", "the same against virtiofsd --cache=always",
           "crates.io's virtiofsd is not installed (cargo install virtiofsd): not measured")
    b.skip("libgit2-build", "libgit2 cmake + make -j in the guest",
           "needs a guest root with a compiler; the busybox initramfs has none: not measured yet")
