//! `/proc/self/mountinfo`: what is mounted where.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// One line of mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub id: u64,
    pub parent: u64,
    /// `major:minor` of the filesystem.
    pub dev: String,
    /// Root of the mount within its filesystem.
    pub root: PathBuf,
    pub mountpoint: PathBuf,
    /// Per-mount options (`ro`, `nosuid`, ...).
    pub mount_options: String,
    pub fstype: String,
    pub source: String,
    /// Per-superblock options (for overlayfs, its layers).
    pub super_options: String,
}

impl MountEntry {
    /// A kernel mount made by tilefs (overlayfs with a `tilefs:` source),
    /// or a tilefs FUSE mount.
    pub fn is_tilefs(&self) -> bool {
        (self.fstype == "overlay" && (self.source == crate::MOUNT_SOURCE || self.source.starts_with("tilefs:")))
            || (self.fstype.starts_with("fuse") && (self.fstype.contains("tilefs") || self.source.contains("tilefs")))
    }

    /// A FUSE mount.
    pub fn is_fuse(&self) -> bool {
        self.fstype == "fuse" || self.fstype.starts_with("fuse.")
    }
}

/// The mount table of this process's mount namespace.
pub fn read() -> std::io::Result<Vec<MountEntry>> {
    let text = std::fs::read("/proc/self/mountinfo")?;
    Ok(parse(&text))
}

/// Parses mountinfo text; malformed lines are skipped.
pub fn parse(text: &[u8]) -> Vec<MountEntry> {
    text.split(|&c| c == b'\n').filter_map(parse_line).collect()
}

fn parse_line(line: &[u8]) -> Option<MountEntry> {
    let fields: Vec<&[u8]> = line.split(|&c| c == b' ').collect();
    let sep = fields.iter().position(|f| *f == b"-")?;
    if sep < 6 || fields.len() < sep + 3 {
        return None;
    }
    let text = |b: &[u8]| String::from_utf8_lossy(&unescape(b)).into_owned();
    Some(MountEntry {
        id: std::str::from_utf8(fields[0]).ok()?.parse().ok()?,
        parent: std::str::from_utf8(fields[1]).ok()?.parse().ok()?,
        dev: text(fields[2]),
        root: PathBuf::from(OsString::from_vec(unescape(fields[3]))),
        mountpoint: PathBuf::from(OsString::from_vec(unescape(fields[4]))),
        mount_options: text(fields[5]),
        fstype: text(fields[sep + 1]),
        source: text(fields[sep + 2]),
        super_options: fields.get(sep + 3).map(|f| text(f)).unwrap_or_default(),
    })
}

/// Undoes the kernel's `\ooo` octal escapes (space, tab, newline, backslash).
pub fn unescape(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\' && i + 3 < s.len() && s[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (s[i + 1] - b'0') as u32 * 64 + (s[i + 2] - b'0') as u32 * 8 + (s[i + 3] - b'0') as u32;
            if v <= 0xff {
                out.push(v as u8);
                i += 4;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// The topmost mount whose mount point is exactly `path` (canonical).
pub fn mounted_at(path: &Path) -> Option<MountEntry> {
    read().ok()?.into_iter().rev().find(|m| m.mountpoint == path)
}

/// Every mount at or below `path`.
pub fn mounts_under(path: &Path) -> Vec<MountEntry> {
    read()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.mountpoint.starts_with(path))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines() {
        let text = b"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n\
45 27 0:40 / /tmp/with\\040space rw,relatime shared:1 - overlay tilefs:/img ro,lowerdir+=/x\n\
bad line\n";
        let m = parse(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].fstype, "ext4");
        assert_eq!(m[0].mountpoint, Path::new("/"));
        assert_eq!(m[1].mountpoint, Path::new("/tmp/with space"));
        assert_eq!(m[1].source, "tilefs:/img");
        assert_eq!(m[1].super_options, "ro,lowerdir+=/x");
        assert!(m[1].is_tilefs());
        assert!(!m[0].is_tilefs());
    }

    #[test]
    fn unescapes() {
        assert_eq!(unescape(b"a\\134b\\012"), b"a\\b\n");
        assert_eq!(unescape(b"tail\\01"), b"tail\\01");
        assert_eq!(unescape(b"\\999"), b"\\999");
    }
}
