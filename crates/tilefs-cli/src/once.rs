//! Facts about the machine said once: a notice that would be the same on
//! every mount (no kernel mount without privilege, no mount service, no
//! fs-verity) is shown the first time in each boot, per user.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;

/// True the first time this boot that `text` is to be said by this user;
/// also true when there is nowhere to remember it.
pub fn first_time(text: &str) -> bool {
    let Some(dir) = runtime_dir() else { return true };
    let dir = dir.join("tilefs/said");
    if std::fs::create_dir_all(&dir).is_err() {
        return true;
    }
    let mut h = std::hash::DefaultHasher::new();
    text.hash(&mut h);
    let marker = dir.join(format!("{:016x}", h.finish()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(marker)
        .is_ok()
}

/// A directory of this user's that lasts until reboot: /run for root,
/// $XDG_RUNTIME_DIR for others (when it is theirs).
fn runtime_dir() -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let me = rustix::process::geteuid();
    if me.is_root() {
        return Some(PathBuf::from("/run"));
    }
    let d = PathBuf::from(std::env::var_os("XDG_RUNTIME_DIR")?);
    let m = std::fs::symlink_metadata(&d).ok()?;
    (d.is_absolute() && m.is_dir() && m.uid() == me.as_raw() && m.mode() & 0o022 == 0).then_some(d)
}
