//! Whether the kernel can check objects with fs-verity, and what an
//! object's fs-verity digest is.

use rustix::fd::AsFd;
use rustix::io::Errno;
use std::io::Read;
use std::path::Path;

/// The fs-verity digest of an open file: `Ok(Some)` when verity is enabled
/// with SHA-256, `Ok(None)` when the file has no verity (or another hash),
/// `Err` when the filesystem or kernel cannot tell (no fs-verity support).
pub fn measure(fd: impl AsFd) -> Result<Option<[u8; 32]>, Errno> {
    tilefs_sys::verity::measure(fd.as_fd())
}

/// Why the kernel cannot check fs-verity digests of files in `dir` (the
/// store), or None when it can.
pub fn unavailable(dir: &Path) -> Option<String> {
    let fd = match rustix::fs::open(
        dir,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(e) => return Some(format!("{}: cannot open: {e}", dir.display())),
    };
    match measure(&fd) {
        // A directory never has verity: ENODATA means the ioctl is there.
        Ok(_) => None,
        Err(_) => Some(explain(&fd, dir)),
    }
}

fn explain(fd: &rustix::fd::OwnedFd, dir: &Path) -> String {
    let fstype = rustix::fs::fstatfs(fd)
        .map(|s| fs_name(s.f_type as u64))
        .unwrap_or("unknown");
    match kernel_config("CONFIG_FS_VERITY") {
        Some(false) => return "this kernel has no fs-verity (it was built without CONFIG_FS_VERITY)".into(),
        None if fstype == "ext4"
            && Path::new("/sys/fs/ext4/features").is_dir()
            && !Path::new("/sys/fs/ext4/features/verity").exists() =>
        {
            return "this kernel has no fs-verity (CONFIG_FS_VERITY: ext4 lists no verity feature in /sys/fs/ext4/features)"
                .into()
        }
        _ => {}
    }
    match fstype {
        "ext4" | "f2fs" => format!(
            "the store's {fstype} filesystem ({}) does not have the verity feature enabled (ext4: tune2fs -O verity DEVICE)",
            dir.display()
        ),
        _ => format!(
            "the store's filesystem ({fstype}, {}) does not support fs-verity (ext4, f2fs and btrfs do)",
            dir.display()
        ),
    }
}

/// `CONFIG_X` of the running kernel, from /proc/config.gz or
/// /boot/config-RELEASE, when either is there.
pub fn kernel_config(option: &str) -> Option<bool> {
    let mut text = String::new();
    if let Ok(f) = std::fs::File::open("/proc/config.gz") {
        let _ = flate2::read::GzDecoder::new(f).read_to_string(&mut text);
    }
    if text.is_empty() {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
        let release = release.trim();
        text = std::fs::read_to_string(format!("/boot/config-{release}")).ok()?;
    }
    for line in text.lines() {
        if line == format!("# {option} is not set") {
            return Some(false);
        }
        if let Some(v) = line.strip_prefix(option).and_then(|r| r.strip_prefix('=')) {
            return Some(v == "y" || v == "m");
        }
    }
    Some(false)
}

fn fs_name(magic: u64) -> &'static str {
    match magic as u32 {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0xF2F5_2010 => "f2fs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlay",
        0xE0F5_E1E2 => "erofs",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        0x2FC1_2FC1 => "zfs",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn support_is_reported_either_way() {
        let dir = std::env::temp_dir();
        match unavailable(&dir) {
            // No fs-verity: the reason names what is missing.
            Some(why) => assert!(why.contains("verity"), "{why}"),
            // fs-verity there: a fresh file has none enabled.
            None => {
                let f = tempfile_in(&dir);
                assert_eq!(measure(&f.0).unwrap(), None);
            }
        }
    }

    struct Tmp(std::fs::File, std::path::PathBuf);
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.1);
        }
    }
    fn tempfile_in(dir: &Path) -> Tmp {
        let p = dir.join(format!("tilefs-verity-test-{}", std::process::id()));
        std::fs::write(&p, b"data").unwrap();
        Tmp(std::fs::File::open(&p).unwrap(), p)
    }

    #[test]
    fn kernel_config_reads_known_options() {
        // Whatever the kernel, a made-up option is "not set" when the
        // configuration is readable at all.
        assert_ne!(kernel_config("CONFIG_TILEFS_NO_SUCH_OPTION"), Some(true));
    }
}
