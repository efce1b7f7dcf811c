//! What a writable mount's upper directory records beyond overlayfs's own
//! markers, shared by the FUSE server that writes it and `tilefs commit`
//! that reads it.
//!
//! A server without privilege cannot give a file another owner, an exact
//! mode it could then not read itself, or make a device: it records them
//! in [`OVERRIDE`] = `UID:GID:MODE[:TYPE]` (the containers/storage
//! convention, read by fuse-overlayfs too), TYPE being `dir`, `symlink`,
//! `pipe`, `socket`, `block-MAJ-MIN` or `char-MAJ-MIN` for an entry stored
//! as a regular file in its stead. xattrs it may not set (`trusted.*`,
//! `security.*`) are kept under [`KEPT_PREFIX`].

/// The xattr holding what the server could not apply.
pub const OVERRIDE: &[u8] = b"user.containers.override_stat";
/// Prefix of xattrs kept for names the server may not set itself.
pub const KEPT_PREFIX: &[u8] = b"user.tilefs.x.";

/// What the override xattr says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Override {
    pub uid: u32,
    pub gid: u32,
    /// Permission bits (07777).
    pub perm: u32,
    /// The type, when the entry on disk is a regular file standing in for
    /// another (S_IFMT bits), with its device number.
    pub typ: Option<(u32, u64)>,
}

impl Override {
    /// None when `v` is not an override (such a value is ignored, as
    /// fuse-overlayfs ignores it).
    pub fn parse(v: &[u8]) -> Option<Override> {
        let s = std::str::from_utf8(v).ok()?;
        let mut it = s.trim_end_matches('\0').split(':');
        let uid = it.next()?.parse().ok()?;
        let gid = it.next()?.parse().ok()?;
        let perm = u32::from_str_radix(it.next()?, 8).ok()? & 0o7777;
        let typ = match it.next() {
            None | Some("file") => None,
            Some("dir") => Some((libc::S_IFDIR, 0)),
            Some("symlink") => Some((libc::S_IFLNK, 0)),
            Some("pipe") => Some((libc::S_IFIFO, 0)),
            Some("socket") => Some((libc::S_IFSOCK, 0)),
            Some(dev) => {
                let (kind, rest) = dev.split_once('-')?;
                let (maj, min) = rest.split_once('-')?;
                let rdev = rustix::fs::makedev(maj.parse().ok()?, min.parse().ok()?);
                match kind {
                    "block" => Some((libc::S_IFBLK, rdev)),
                    "char" => Some((libc::S_IFCHR, rdev)),
                    _ => return None,
                }
            }
        };
        Some(Override { uid, gid, perm, typ })
    }

    pub fn format(&self) -> String {
        let typ = match self.typ {
            None => String::new(),
            Some((t, rdev)) => match t {
                libc::S_IFDIR => ":dir".into(),
                libc::S_IFLNK => ":symlink".into(),
                libc::S_IFIFO => ":pipe".into(),
                libc::S_IFSOCK => ":socket".into(),
                libc::S_IFBLK => format!(":block-{}-{}", rustix::fs::major(rdev), rustix::fs::minor(rdev)),
                libc::S_IFCHR => format!(":char-{}-{}", rustix::fs::major(rdev), rustix::fs::minor(rdev)),
                _ => String::new(),
            },
        };
        format!("{}:{}:{:04o}{typ}", self.uid, self.gid, self.perm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_round_trip() {
        for o in [
            Override {
                uid: 0,
                gid: 0,
                perm: 0o755,
                typ: None,
            },
            Override {
                uid: 70000,
                gid: 5,
                perm: 0o4711,
                typ: Some((libc::S_IFCHR, rustix::fs::makedev(1, 3))),
            },
            Override {
                uid: 1,
                gid: 2,
                perm: 0o777,
                typ: Some((libc::S_IFLNK, 0)),
            },
        ] {
            assert_eq!(Override::parse(o.format().as_bytes()), Some(o), "{}", o.format());
        }
        assert_eq!(Override::parse(b"0:0:0644").unwrap().perm, 0o644);
        assert_eq!(
            Override::parse(b"1:2:777:symlink").unwrap().typ,
            Some((libc::S_IFLNK, 0))
        );
        for bad in [
            &b""[..],
            b"x:0:0644",
            b"0:0",
            b"0:0:9",
            b"0:0:0644:char-1",
            b"0:0:0644:tape-1-2",
        ] {
            assert_eq!(Override::parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }
}
