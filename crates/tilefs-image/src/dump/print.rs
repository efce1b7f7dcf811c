//! composefs-dump(5) printer.
//!
//! Output matches `composefs-info dump`: one line per directory entry,
//! depth-first in name order, with the root first as `/`. A hardlink entry
//! (one whose inode's primary entry is elsewhere) prints the inode's fields
//! with `@` before the mode and the primary entry's path as its payload.

use crate::tree::{Entry, Inode, InodeId, Tree, ROOT};
use std::collections::HashMap;
use std::io::{self, Write};

/// Output is handed to the writer in chunks of about this size.
const CHUNK: usize = 64 * 1024;

/// Which characters a field escapes, beyond backslash, control characters,
/// space and non-ASCII bytes (everything outside `!`..=`~`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Escape {
    /// Paths: nothing more.
    Path,
    /// Optional fields (payload, content): a value that is exactly `-` is
    /// written `\x2d` so that it cannot be read as "absent".
    Optional,
    /// Xattr names and values: `=` as well, which separates them.
    Xattr,
}

const HEX: &[u8; 16] = b"0123456789abcdef";

#[inline]
fn plain(c: u8, how: Escape) -> bool {
    (b'!'..=b'~').contains(&c) && c != b'\\' && !(how == Escape::Xattr && c == b'=')
}

/// Appends `s` to `out`, escaped as the field kind `how` requires.
pub(super) fn escape_into(out: &mut Vec<u8>, s: &[u8], how: Escape) {
    if how == Escape::Optional && s == b"-" {
        out.extend_from_slice(b"\\x2d");
        return;
    }
    // Most fields need no escaping at all: copy the plain prefix in one go.
    let start = s.iter().position(|&c| !plain(c, how)).unwrap_or(s.len());
    out.extend_from_slice(&s[..start]);
    for &c in &s[start..] {
        if plain(c, how) {
            out.push(c);
            continue;
        }
        match c {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            _ => out.extend_from_slice(&[b'\\', b'x', HEX[(c >> 4) as usize], HEX[(c & 15) as usize]]),
        }
    }
}

/// `s` escaped as a path, for error messages.
pub(super) fn escaped(s: &[u8], how: Escape) -> String {
    let mut out = Vec::with_capacity(s.len());
    escape_into(&mut out, s, how);
    // Escaped text is printable ASCII only.
    String::from_utf8_lossy(&out).into_owned()
}

fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&tmp[i..]);
}

fn push_i64(out: &mut Vec<u8>, v: i64) {
    if v < 0 {
        out.push(b'-');
    }
    push_u64(out, v.unsigned_abs());
}

fn push_octal(out: &mut Vec<u8>, mut v: u32) {
    let mut tmp = [0u8; 11];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (v & 7) as u8;
        v >>= 3;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&tmp[i..]);
}

fn push_optional(out: &mut Vec<u8>, v: Option<&[u8]>) {
    match v {
        Some(v) => escape_into(out, v, Escape::Optional),
        None => out.push(b'-'),
    }
}

/// Appends one dump line for `inode` at `path`; `hardlink_to` is the path
/// of the inode's primary entry when this entry is a hardlink.
fn push_line(out: &mut Vec<u8>, path: &[u8], inode: &Inode, hardlink_to: Option<&[u8]>) {
    escape_into(out, path, Escape::Path);
    out.push(b' ');
    push_u64(out, inode.size);
    out.push(b' ');
    if hardlink_to.is_some() {
        out.push(b'@');
    }
    push_octal(out, inode.mode);
    for v in [inode.nlink, inode.uid, inode.gid, inode.rdev] {
        out.push(b' ');
        push_u64(out, v.into());
    }
    out.push(b' ');
    push_i64(out, inode.mtime.sec);
    out.push(b'.');
    push_u64(out, inode.mtime.nsec.into());
    out.push(b' ');
    push_optional(out, hardlink_to.or(inode.payload.as_deref()));
    out.push(b' ');
    push_optional(out, inode.content.as_deref());
    out.push(b' ');
    match &inode.digest {
        Some(d) => {
            for &b in d {
                out.extend_from_slice(&[HEX[(b >> 4) as usize], HEX[(b & 15) as usize]]);
            }
        }
        None => out.push(b'-'),
    }
    for x in &inode.xattrs {
        out.push(b' ');
        escape_into(out, &x.key, Escape::Xattr);
        out.push(b'=');
        escape_into(out, &x.value, Escape::Xattr);
    }
    out.push(b'\n');
}

/// Visits every entry depth-first in name order, with its full path, root
/// first as `/`: the order of [`Tree::walk`], but with an explicit stack,
/// so that a very deep tree cannot overflow the thread's stack.
pub(super) fn walk(tree: &Tree, mut f: impl FnMut(&[u8], Option<&Entry>, InodeId)) {
    let mut path = Vec::with_capacity(256);
    path.push(b'/');
    f(&path, None, ROOT);
    // (directory, index of its next entry, length of its path)
    let mut stack: Vec<(InodeId, usize, usize)> = vec![(ROOT, 0, 1)];
    while let Some(top) = stack.last_mut() {
        let (dir, i, base) = *top;
        let Some(e) = tree.inode(dir).entries.get(i) else {
            stack.pop();
            continue;
        };
        top.1 += 1;
        path.truncate(base);
        if base > 1 {
            path.push(b'/');
        }
        path.extend_from_slice(&e.name);
        f(&path, Some(e), e.inode);
        if !e.hardlink && tree.inode(e.inode).is_dir() {
            stack.push((e.inode, 0, path.len()));
        }
    }
}

/// For every inode that some hardlink entry points at, the path of its
/// primary entry (the first one in walk order).
fn primary_paths(tree: &Tree) -> HashMap<InodeId, Vec<u8>> {
    let mut wanted: HashMap<InodeId, Option<Vec<u8>>> = HashMap::new();
    for inode in &tree.inodes {
        for e in inode.entries.iter().filter(|e| e.hardlink) {
            wanted.insert(e.inode, None);
        }
    }
    if wanted.is_empty() {
        return HashMap::new();
    }
    walk(tree, |path, entry, id| {
        if entry.is_some_and(|e| e.hardlink) {
            return;
        }
        if let Some(slot @ None) = wanted.get_mut(&id) {
            *slot = Some(path.to_vec());
        }
    });
    wanted.into_iter().filter_map(|(id, p)| Some((id, p?))).collect()
}

/// Prints `tree` as dump text, one line per entry, depth-first in name order.
///
/// Xattrs are printed in the order the inode holds them. Fails with
/// `InvalidInput` if a hardlink entry points at an inode that has no
/// primary entry in the tree.
pub fn print(tree: &Tree, out: &mut impl Write) -> io::Result<()> {
    let primary = primary_paths(tree);
    let mut buf = Vec::with_capacity(CHUNK + 4096);
    let mut result = Ok(());
    walk(tree, |path, entry, id| {
        if result.is_err() {
            return;
        }
        let hardlink_to = match entry {
            Some(e) if e.hardlink => match primary.get(&id) {
                Some(p) => Some(p.as_slice()),
                None => {
                    result = Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "{}: hardlink to an inode that has no primary entry",
                            escaped(path, Escape::Path)
                        ),
                    ));
                    return;
                }
            },
            _ => None,
        };
        push_line(&mut buf, path, tree.inode(id), hardlink_to);
        if buf.len() >= CHUNK {
            result = out.write_all(&buf);
            buf.clear();
        }
    });
    result?;
    out.write_all(&buf)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{Inode, Timespec, EXTERNAL_XATTR_BUDGET, S_IFCHR, S_IFDIR, S_IFLNK, S_IFREG};

    fn esc(s: &[u8], how: Escape) -> String {
        escaped(s, how)
    }

    #[test]
    fn escaping() {
        assert_eq!(esc(b"/a b", Escape::Path), "/a\\x20b");
        assert_eq!(esc(b"a\\b\n\r\t", Escape::Path), "a\\\\b\\n\\r\\t");
        assert_eq!(esc(b"k=v", Escape::Path), "k=v");
        assert_eq!(esc(b"k=v", Escape::Optional), "k=v");
        assert_eq!(esc(b"k=v", Escape::Xattr), "k\\x3dv");
        assert_eq!(esc(b"-", Escape::Optional), "\\x2d");
        assert_eq!(esc(b"-", Escape::Xattr), "-");
        assert_eq!(esc(b"-", Escape::Path), "-");
        assert_eq!(esc(b"--", Escape::Optional), "--");
        assert_eq!(
            esc(&[0, 0x1f, 0x7f, 0x80, 0xff, b'~', b'!'], Escape::Path),
            "\\x00\\x1f\\x7f\\x80\\xff~!"
        );
        assert_eq!(esc(b"", Escape::Optional), "");
    }

    #[test]
    fn numbers() {
        let mut v = Vec::new();
        push_u64(&mut v, 0);
        v.push(b' ');
        push_u64(&mut v, u64::MAX);
        v.push(b' ');
        push_i64(&mut v, i64::MIN);
        v.push(b' ');
        push_i64(&mut v, -1);
        v.push(b' ');
        push_octal(&mut v, 0o100644);
        v.push(b' ');
        push_octal(&mut v, u32::MAX);
        v.push(b' ');
        push_octal(&mut v, 0);
        assert_eq!(
            String::from_utf8(v).unwrap(),
            "0 18446744073709551615 -9223372036854775808 -1 100644 37777777777 0"
        );
    }

    fn sample() -> Tree {
        let mut root = Inode::new(S_IFDIR | 0o755);
        root.nlink = 3;
        root.size = 4096;
        root.mtime = Timespec { sec: -5, nsec: 7 };
        root.set_xattr(b"user.a=b", b"x y", EXTERNAL_XATTR_BUDGET).unwrap();
        let mut tree = Tree::new(root);
        let mut f = Inode::new(S_IFREG | 0o644);
        f.size = 1;
        f.nlink = 2;
        f.content = Some(b"-".to_vec());
        let dir = tree.add_child(0, b"d ir", Inode::new(S_IFDIR | 0o700)).unwrap();
        let fid = tree.add_child(dir, b"f", f).unwrap();
        tree.link(0, b"a-link", fid, true).unwrap();
        let mut l = Inode::new(S_IFLNK | 0o777);
        l.payload = Some(b"-".to_vec());
        l.size = 1;
        tree.add_child(0, b"sym", l).unwrap();
        let mut c = Inode::new(S_IFCHR | 0o600);
        c.rdev = 0x1234;
        c.digest = Some([0xab; 32]);
        tree.add_child(0, b"z", c).unwrap();
        tree
    }

    #[test]
    fn prints_like_composefs_info() {
        let mut out = Vec::new();
        print(&sample(), &mut out).unwrap();
        let d = "ab".repeat(32);
        let want = format!(
            "/ 4096 40755 3 0 0 0 -5.7 - - - user.a\\x3db=x\\x20y\n\
             /a-link 1 @100644 2 0 0 0 0.0 /d\\x20ir/f \\x2d -\n\
             /d\\x20ir 0 40700 1 0 0 0 0.0 - - -\n\
             /d\\x20ir/f 1 100644 2 0 0 0 0.0 - \\x2d -\n\
             /sym 1 120777 1 0 0 0 0.0 \\x2d - -\n\
             /z 0 20600 1 0 0 4660 0.0 - - {d}\n"
        );
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }

    #[test]
    fn hardlink_without_primary_is_an_error() {
        let mut tree = sample();
        let f = tree.lookup_path(b"/d ir/f").unwrap();
        let dir = tree.lookup_path(b"/d ir").unwrap();
        tree.inode_mut(dir).entries[0].hardlink = true;
        assert_eq!(tree.inode(dir).entries[0].inode, f);
        let err = print(&tree, &mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn walk_matches_tree_walk() {
        let tree = sample();
        let mut a = Vec::new();
        tree.walk(|p, e, id| a.push((p.to_vec(), e.cloned(), id)));
        let mut b = Vec::new();
        walk(&tree, |p, e, id| b.push((p.to_vec(), e.cloned(), id)));
        assert_eq!(a, b);
    }

    #[test]
    fn deep_tree() {
        // Deeper than a recursive walk could go on a test thread's stack.
        let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755));
        let mut dir = 0;
        for _ in 0..200_000 {
            dir = tree.add_child(dir, b"d", Inode::new(S_IFDIR | 0o755)).unwrap();
        }
        let mut n = 0;
        let mut longest = 0;
        walk(&tree, |p, _, _| {
            n += 1;
            longest = longest.max(p.len());
        });
        assert_eq!((n, longest), (200_001, 400_000));
    }

    #[test]
    fn large_output_is_chunked() {
        let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755));
        for i in 0..5000u32 {
            tree.add_child(0, format!("file-{i:05}").as_bytes(), Inode::new(S_IFREG | 0o644))
                .unwrap();
        }
        let mut out = Vec::new();
        print(&tree, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 5001);
        assert!(text.ends_with("/file-04999 0 100644 1 0 0 0 0.0 - - -\n"));
    }
}
