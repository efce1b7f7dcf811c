//! composefs-dump(5) parser.
//!
//! Each line is `PATH SIZE MODE NLINK UID GID RDEV MTIME PAYLOAD CONTENT
//! DIGEST [KEY=VALUE]...`, fields separated by single spaces. Text fields
//! use `\\`, `\n`, `\r`, `\t` and `\xHH` escapes; optional fields hold `-`
//! when absent. A mode starting with `@` makes the line a hardlink to the
//! path in PAYLOAD (which may come later in the dump); every other field
//! of such a line is ignored.
//!
//! The dump is parsed into a [`FlatTree`] ([`parse_flat`], what image
//! builds use) or a [`Tree`] ([`parse`]). Lines are parsed where the reader
//! buffers them (copied only when one spans two reads), fields without
//! escapes are used in place, and names, payloads and contents go straight
//! into the tree's arenas. Directory lookups are binary searches, and the
//! directories of the previous line's path are remembered (a dump lists a
//! directory's entries together), so the cost is linear in the input even
//! for unsorted dumps (names arriving out of order go to a per-directory
//! side map that is merged in at the end). [`parse`] numbers the inodes in
//! depth-first name order, so the tree does not depend on line order.
//!
//! What is accepted follows the reference `mkcomposefs --from-file`
//! (lenient by default, its `CFS_PARSE_STRICT` mode with
//! [`ParseOptions::strict`]), except where the reference would go on with
//! garbage; those inputs are refused here:
//! - numbers must be plain decimal (octal for MODE) digits that fit: no
//!   sign, space or overflow, NLINK/UID/GID/MODE at most 32 bits (the
//!   reference truncates). MTIME seconds may be negative, as
//!   `composefs-info` prints them; RDEV and nanoseconds are truncated to 32
//!   bits as in the image;
//! - an invalid GID or RDEV is an error (the reference checks the wrong
//!   variable and takes them as 0 when the UID is not 0);
//! - DIGEST must be 64 hex digits (or `-`, or empty when the line ends
//!   early);
//! - a NUL byte (as `\x00`) in a path, symlink target, payload, hardlink
//!   target or xattr name is refused, not cut off there;
//! - hardlinks to directories (through an `@` line with a non-directory
//!   mode) and cycles of hardlinks are refused;
//! - a regular file too large for the image's chunk table is refused here,
//!   where the reference fails only when writing the image;
//! - lines longer than [`MAX_LINE_LEN`] are refused.

use super::print::{escaped, Escape};
use crate::erofs::format::{chunk_count, MAX_EXTERNAL_CHUNKS};
use crate::flat::{FlatEntry, FlatInode, FlatTree, Meta, TooLarge};
use crate::tree::{
    check_xattr, validate_name, xattr_entry_budget, FileType, InodeId, Timespec, Tree, TreeError,
    EXTERNAL_XATTR_BUDGET, MAX_INLINE_CONTENT, MAX_PAYLOAD_LEN, ROOT, XATTR_HEADER_BUDGET,
};
use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;

/// How strictly to parse.
#[derive(Debug, Clone, Copy, Default)]
pub struct ParseOptions {
    /// Refuse what the reference accepts only in its lenient mode.
    pub strict: bool,
}

/// A dump that cannot be parsed: the line (1-based, 0 when not tied to a
/// line) and the reason.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct DumpError {
    pub line: usize,
    pub reason: String,
}

/// Longest line we read. The format's own limits keep real lines far
/// shorter (64 KiB of xattr text, 5000 bytes of content, 4095 of payload,
/// each at most four times longer escaped); this bounds memory for hostile
/// input, e.g. a hardlink line whose ignored fields go on forever.
const MAX_LINE_LEN: usize = 1 << 20;

/// Most xattr bytes (names and values, unescaped) a line may carry. The
/// reference caps the escaped text instead, so a dump it prints for an
/// image with long binary values does not parse again; counting decoded
/// bytes keeps `build(dump(image)) == image` true for every image, and the
/// per-inode xattr budget refuses the same trees either way.
const MAX_XATTR_BYTES: usize = u16::MAX as usize;

/// Entries of hardlink lines point at `PENDING | fixup index` until the
/// targets are resolved at the end of the input.
const PENDING: InodeId = 1 << 31;

const FIELD_NAMES: [&str; 11] = [
    "PATH", "SIZE", "MODE", "NLINK", "UID", "GID", "RDEV", "MTIME", "PAYLOAD", "CONTENT", "DIGEST",
];
const PATH: usize = 0;
const SIZE: usize = 1;
const MODE: usize = 2;
const NLINK: usize = 3;
const UID: usize = 4;
const GID: usize = 5;
const RDEV: usize = 6;
const MTIME: usize = 7;
const PAYLOAD: usize = 8;
const CONTENT: usize = 9;
const DIGEST: usize = 10;

/// Parses a whole dump into a tree.
///
/// The first line must be the root directory `/`, and every other entry's
/// parent directory must come before it. Errors carry the 1-based line
/// number; errors about the dump as a whole (it is empty) carry line 0.
pub fn parse(input: impl BufRead, opts: ParseOptions) -> Result<Tree, DumpError> {
    let flat = parse_flat(input, opts)?;
    let mut tree = flat.to_tree();
    drop(flat);
    renumber(&mut tree);
    Ok(tree)
}

/// Parses a whole dump into a [`FlatTree`], as [`parse`] does (the same
/// checks and errors), with inodes numbered in line order.
pub fn parse_flat(mut input: impl BufRead, opts: ParseOptions) -> Result<FlatTree, DumpError> {
    let mut parser = Parser::new(opts);
    // A line that spans two reads of the buffer.
    let mut carry: Vec<u8> = Vec::new();
    let mut line_no = 0usize;
    let too_long = |line: usize| DumpError {
        line,
        reason: format!("line is longer than {MAX_LINE_LEN} bytes"),
    };
    loop {
        let buf = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(DumpError {
                    line: line_no + 1,
                    reason: format!("read error: {e}"),
                })
            }
        };
        if buf.is_empty() {
            if !carry.is_empty() {
                // The last line, without a newline.
                line_no += 1;
                if opts.strict {
                    return Err(DumpError {
                        line: line_no,
                        reason: "missing newline at the end of the last line".into(),
                    });
                }
                parser
                    .line(&carry, line_no)
                    .map_err(|reason| DumpError { line: line_no, reason })?;
            }
            break;
        }
        let Some(i) = memchr::memchr(b'\n', buf) else {
            if carry.len() + buf.len() > MAX_LINE_LEN {
                return Err(too_long(line_no + 1));
            }
            carry.extend_from_slice(buf);
            let n = buf.len();
            input.consume(n);
            continue;
        };
        line_no += 1;
        if carry.len() + i > MAX_LINE_LEN {
            return Err(too_long(line_no));
        }
        let result = if carry.is_empty() {
            parser.line(&buf[..i], line_no)
        } else {
            carry.extend_from_slice(&buf[..i]);
            let r = parser.line(&carry, line_no);
            carry.clear();
            r
        };
        result.map_err(|reason| DumpError { line: line_no, reason })?;
        input.consume(i + 1);
    }
    parser.finish()
}

/// A hardlink line waiting for the end of the input, when all its possible
/// targets are known.
struct Fixup {
    dir: InodeId,
    /// The link's own path; its last component is the entry's name.
    path: Vec<u8>,
    target: Vec<u8>,
    line: usize,
}

#[derive(Clone, Copy)]
enum Resolution {
    Unvisited,
    InProgress,
    Done(InodeId),
}

/// Buffers reused from line to line.
#[derive(Default)]
struct Scratch {
    path: Vec<u8>,
    payload: Vec<u8>,
    content: Vec<u8>,
    /// Unescaped xattr names and values of the line, and their ranges.
    xattr_bytes: Vec<u8>,
    xattr_ranges: Vec<(usize, usize, usize)>,
    /// The line's xattrs after repeated names are resolved: indexes into
    /// `xattr_ranges`.
    slots: Vec<Option<usize>>,
    ids: Vec<u32>,
}

struct Parser {
    strict: bool,
    tree: FlatTree,
    have_root: bool,
    /// Entries that arrived out of name order, per directory: every name
    /// here sorts before the directory's last entry in the tree.
    late: HashMap<InodeId, BTreeMap<Vec<u8>, FlatEntry>>,
    fixups: Vec<Fixup>,
    /// The directory path of the previous line (as written, unescaped) and
    /// the directory each of its components names: dumps list siblings
    /// together, so most lines reuse all of it and the others part of it.
    cached_path: Vec<u8>,
    cached: Vec<(std::ops::Range<usize>, InodeId)>,
    /// Whether the current line has a `\\` (else no field needs decoding).
    escapes: bool,
    /// The previous `cached`, kept for its allocation.
    resolved: Vec<(std::ops::Range<usize>, InodeId)>,
    s: Scratch,
}

/// Splits the next space-separated field off `rest`. Past the end of the
/// line, fields are empty.
#[inline]
fn next_field<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    let s = *rest;
    match memchr::memchr(b' ', s) {
        Some(i) => {
            *rest = &s[i + 1..];
            &s[..i]
        }
        None => {
            *rest = &[];
            s
        }
    }
}

fn show(s: &[u8]) -> String {
    escaped(s, Escape::Path)
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Decodes the escapes of a text field: the field itself when it has none,
/// else its decoded bytes in `out`.
#[inline]
fn unescape<'a>(s: &'a [u8], out: &'a mut Vec<u8>) -> Result<&'a [u8], String> {
    let Some(first) = memchr::memchr(b'\\', s) else {
        return Ok(s);
    };
    out.clear();
    unescape_slow(s, first, out)?;
    Ok(&out[..])
}

/// Appends the decoded `s` to `out`; `first` is the first `\` in `s`.
fn unescape_slow(s: &[u8], first: usize, out: &mut Vec<u8>) -> Result<(), String> {
    out.reserve(s.len());
    let mut rest = s;
    let mut next = Some(first);
    while let Some(i) = next {
        out.extend_from_slice(&rest[..i]);
        let (c, len) = match rest.get(i + 1) {
            None => return Err("'\\' at the end of the field".into()),
            Some(b'\\') => (b'\\', 2),
            Some(b'n') => (b'\n', 2),
            Some(b'r') => (b'\r', 2),
            Some(b't') => (b'\t', 2),
            Some(b'x') => match (rest.get(i + 2), rest.get(i + 3)) {
                (Some(&h), Some(&l)) => match (hex_digit(h), hex_digit(l)) {
                    (Some(h), Some(l)) => (h << 4 | l, 4),
                    _ => return Err(format!("invalid hex escape {}", show(&rest[i..i + 4]))),
                },
                _ => return Err("'\\x' escape without two hex digits".into()),
            },
            Some(&c) => return Err(format!("unknown escape {}", show(&[b'\\', c]))),
        };
        out.push(c);
        rest = &rest[i + len..];
        next = memchr::memchr(b'\\', rest);
    }
    out.extend_from_slice(rest);
    Ok(())
}

/// Appends the decoded `s` to `out`.
fn unescape_append(s: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    match memchr::memchr(b'\\', s) {
        None => {
            out.extend_from_slice(s);
            Ok(())
        }
        Some(first) => unescape_slow(s, first, out),
    }
}

/// Decodes field `idx` of `f`, naming the field in errors. `escapes`:
/// whether the line has any `\` at all.
#[inline]
fn text_field<'a>(f: &[&'a [u8]; 11], idx: usize, out: &'a mut Vec<u8>, escapes: bool) -> Result<&'a [u8], String> {
    if !escapes {
        return Ok(f[idx]);
    }
    unescape(f[idx], out).map_err(|e| format!("{}: {e}", FIELD_NAMES[idx]))
}

/// Decodes an optional field: `None` for `-`.
#[inline]
fn optional_field<'a>(
    f: &[&'a [u8]; 11],
    idx: usize,
    out: &'a mut Vec<u8>,
    escapes: bool,
) -> Result<Option<&'a [u8]>, String> {
    if f[idx] == b"-" {
        Ok(None)
    } else {
        text_field(f, idx, out, escapes).map(Some)
    }
}

/// A line's 11 fields, the xattr text after them, and whether it has a `\\`.
type Fields<'a> = ([&'a [u8]; 11], &'a [u8], bool);

/// Splits a line into its 11 fields and the xattr text after them, in one
/// pass that also tells whether the line has any `\` (else no field needs
/// decoding) and refuses a NUL byte. Past the end of the line, fields are
/// empty.
#[inline]
fn split_line(line: &[u8]) -> Result<Fields<'_>, String> {
    let mut f: [&[u8]; 11] = [&[]; 11];
    let mut n = 0;
    let mut start = 0;
    let mut escapes = false;
    for i in memchr::memchr3_iter(b' ', b'\\', 0, line) {
        match line[i] {
            0 => return Err(format!("NUL byte at column {} (write it as \\x00)", i + 1)),
            b'\\' => escapes = true,
            _ if n < 11 => {
                f[n] = &line[start..i];
                n += 1;
                start = i + 1;
            }
            _ => {}
        }
    }
    if n < 11 {
        f[n] = &line[start..];
        return Ok((f, &[], escapes));
    }
    Ok((f, &line[start..], escapes))
}

/// An unsigned number: one or more digits of `radix`, no sign, no spaces,
/// no overflow.
#[inline]
fn number(s: &[u8], radix: u32) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    s.iter().try_fold(0u64, |acc, &c| {
        let d = c.wrapping_sub(b'0') as u64;
        if d >= radix as u64 {
            return None;
        }
        acc.checked_mul(radix.into())?.checked_add(d)
    })
}

fn invalid(f: &[&[u8]; 11], idx: usize, what: &str) -> String {
    format!("invalid {} '{}': {what}", FIELD_NAMES[idx], show(f[idx]))
}

fn dec_u64(f: &[&[u8]; 11], idx: usize) -> Result<u64, String> {
    number(f[idx], 10).ok_or_else(|| invalid(f, idx, "expected a decimal number"))
}

fn dec_u32(f: &[&[u8]; 11], idx: usize) -> Result<u32, String> {
    // The reference silently truncates these to 32 bits; a value that does
    // not fit is refused here instead.
    let v = dec_u64(f, idx)?;
    u32::try_from(v).map_err(|_| invalid(f, idx, "larger than 4294967295"))
}

/// `SECONDS.NANOSECONDS`. The reference reads the seconds as an unsigned
/// 64-bit number (where `-N` wraps around) and stores them signed, and
/// `composefs-info` prints negative times with a `-`: accept that sign so
/// that such times survive a round trip. Nanoseconds are truncated to 32
/// bits like the reference's.
fn mtime(f: &[&[u8]; 11]) -> Result<Timespec, String> {
    let s = f[MTIME];
    let bad = || invalid(f, MTIME, "expected SECONDS.NANOSECONDS");
    let dot = memchr::memchr(b'.', s).ok_or_else(bad)?;
    let (sec, nsec) = (&s[..dot], &s[dot + 1..]);
    let sec = match sec.strip_prefix(b"-") {
        Some(abs) => 0u64.wrapping_sub(number(abs, 10).ok_or_else(bad)?),
        None => number(sec, 10).ok_or_else(bad)?,
    };
    let nsec = number(nsec, 10).ok_or_else(bad)?;
    Ok(Timespec {
        sec: sec as i64,
        nsec: nsec as u32,
    })
}

fn digest(f: &[&[u8]; 11], scratch: &mut Vec<u8>, escapes: bool) -> Result<Option<[u8; 32]>, String> {
    let Some(text) = optional_field(f, DIGEST, scratch, escapes)? else {
        return Ok(None);
    };
    // The reference decodes whatever hex is there and leaves the rest of
    // the digest undefined. An empty field (a line that stops early, as in
    // a fuzzer-made vector it accepts) is taken as no digest; anything else
    // must be a full digest.
    if text.is_empty() {
        return Ok(None);
    }
    decode_digest(text)
        .map(Some)
        .ok_or_else(|| invalid(f, DIGEST, "expected 64 hex digits (a SHA-256 fs-verity digest)"))
}

/// 64 hex digits (either case) as 32 bytes; a table lookup per digit and
/// one check at the end, since every regular file of a dump has a digest.
fn decode_digest(text: &[u8]) -> Option<[u8; 32]> {
    static VALUE: [u8; 256] = {
        let mut t = [0xffu8; 256];
        let mut c = 0;
        while c < 10 {
            t[b'0' as usize + c] = c as u8;
            c += 1;
        }
        let mut c = 0;
        while c < 6 {
            t[b'a' as usize + c] = 10 + c as u8;
            t[b'A' as usize + c] = 10 + c as u8;
            c += 1;
        }
        t
    };
    let text: &[u8; 64] = text.try_into().ok()?;
    let mut raw = [0u8; 32];
    let mut bad = 0u8;
    for (byte, pair) in raw.iter_mut().zip(text.chunks_exact(2)) {
        let (h, l) = (VALUE[pair[0] as usize], VALUE[pair[1] as usize]);
        bad |= h | l;
        *byte = h << 4 | (l & 0xf);
    }
    (bad & 0xf0 == 0).then_some(raw)
}

fn too_large(e: TooLarge) -> String {
    e.to_string()
}

impl Parser {
    fn new(opts: ParseOptions) -> Parser {
        Parser {
            strict: opts.strict,
            tree: FlatTree::new(Meta::default()),
            have_root: false,
            late: HashMap::new(),
            fixups: Vec::new(),
            cached_path: Vec::new(),
            cached: Vec::new(),
            escapes: false,
            resolved: Vec::new(),
            s: Scratch::default(),
        }
    }

    fn line(&mut self, line: &[u8], line_no: usize) -> Result<(), String> {
        let (f, xattr_text, escapes) = split_line(line)?;
        self.escapes = escapes;
        let mut path_buf = std::mem::take(&mut self.s.path);
        let r = self.line_at(line_no, &f, xattr_text, &mut path_buf);
        self.s.path = path_buf;
        r
    }

    fn line_at(
        &mut self,
        line_no: usize,
        f: &[&[u8]; 11],
        xattr_text: &[u8],
        path_buf: &mut Vec<u8>,
    ) -> Result<(), String> {
        let path = text_field(f, PATH, path_buf, self.escapes)?;
        if path.is_empty() {
            return Err("empty path".into());
        }
        if memchr::memchr(0, path).is_some() {
            return Err(format!("path {} contains a NUL byte", show(path)));
        }
        let (is_hardlink, mode_text) = match f[MODE].strip_prefix(b"@") {
            Some(m) => (true, m),
            None => (false, f[MODE]),
        };
        let mode = number(mode_text, 8)
            .and_then(|m| u32::try_from(m).ok())
            .ok_or_else(|| invalid(f, MODE, "expected an octal number"))?;
        let ftype = FileType::from_mode(mode)
            .ok_or_else(|| format!("{}: invalid mode {mode:o}: unknown file type", show(path)))?;

        if path == b"/" {
            if self.have_root {
                return Err("second line for the root directory /".into());
            }
            if ftype != FileType::Directory {
                return Err(format!("the root / must be a directory, not a {ftype}"));
            }
            if is_hardlink {
                return Err("the root / cannot be a hardlink".into());
            }
            let root = self.inode(path, f, mode, ftype, xattr_text)?;
            self.tree.inodes[ROOT as usize] = root;
            self.have_root = true;
            return Ok(());
        }
        if !self.have_root {
            return Err(format!("{}: the first line must be the root directory /", show(path)));
        }

        let (dir, name) = self.place(path)?;
        if is_hardlink {
            if ftype == FileType::Directory {
                return Err(format!("{}: directories cannot be hardlinked", show(path)));
            }
            let mut target = Vec::new();
            match f[PAYLOAD] {
                b"-" => return Err(format!("{}: hardlink without a target path in PAYLOAD", show(path))),
                t => unescape_append(t, &mut target).map_err(|e| format!("{}: {e}", FIELD_NAMES[PAYLOAD]))?,
            }
            if target.contains(&0) {
                return Err(format!("{}: hardlink target contains a NUL byte", show(path)));
            }
            let idx = self.fixups.len() as InodeId;
            if idx >= PENDING {
                return Err("too many hardlinks".into());
            }
            self.insert(dir, name, PENDING | idx, true)?;
            self.fixups.push(Fixup {
                dir,
                path: path.to_vec(),
                target,
                line: line_no,
            });
            return Ok(());
        }
        let inode = self.inode(path, f, mode, ftype, xattr_text)?;
        if self.tree.inodes.len() >= PENDING as usize {
            return Err("too many files".into());
        }
        let is_dir = inode.meta.is_dir();
        let id = self.tree.push_inode(inode).map_err(too_large)?;
        self.insert(dir, name, id, false)?;
        if is_dir {
            // The next lines are most likely this directory's children.
            let start = path.len() - name.len();
            self.cached_path.clear();
            self.cached_path.extend_from_slice(path);
            self.cached.push((start..path.len(), id));
        }
        Ok(())
    }

    /// The entry `name` in directory `dir`, as stored so far (possibly a
    /// pending hardlink).
    fn child(&self, dir: InodeId, name: &[u8]) -> Option<InodeId> {
        let t = &self.tree;
        let entries = t.entries(dir);
        if let Ok(i) = entries.binary_search_by(|e| t.name(e).cmp(name)) {
            return Some(entries[i].inode);
        }
        self.late.get(&dir)?.get(name).map(|e| e.inode)
    }

    /// Finds the parent directory of `path` and checks that its last
    /// component can be added there.
    fn place<'p>(&mut self, path: &'p [u8]) -> Result<(InodeId, &'p [u8]), String> {
        let (prefix, name) = match memchr::memrchr(b'/', path) {
            Some(i) => (&path[..i], &path[i + 1..]),
            None => (&path[..0], path),
        };
        let dir = if self.cached_path == prefix {
            self.cached.last().map_or(ROOT, |c| c.1)
        } else {
            self.resolve_dir(path, prefix)?
        };
        validate_name(name).map_err(|e| format!("{}: {e}", show(path)))?;
        // A name after the directory's last one is new (the common case);
        // only others need a search.
        let t = &self.tree;
        let after_last = match t.entries(dir).last() {
            Some(last) => t.name(last) < name,
            None => true,
        };
        if !after_last && self.child(dir, name).is_some() {
            return Err(format!("{} is already in the dump", show(path)));
        }
        Ok((dir, name))
    }

    /// The directory named by `prefix`, the parent path of `path`; the
    /// leading components it shares with the remembered path are not looked
    /// up again. It becomes the remembered path.
    fn resolve_dir(&mut self, path: &[u8], prefix: &[u8]) -> Result<InodeId, String> {
        let not_dir = || format!("{}: parent {} is not a directory", show(path), show(prefix));
        let missing = || format!("{}: parent directory {} is missing", show(path), show(prefix));
        let mut new = std::mem::take(&mut self.resolved);
        new.clear();
        let mut cur = ROOT;
        let mut pos = 0;
        let mut same = true;
        for comp in prefix.split(|&c| c == b'/') {
            let r = pos..pos + comp.len();
            pos += comp.len() + 1;
            if comp.is_empty() {
                continue;
            }
            if same {
                if let Some((cr, id)) = self.cached.get(new.len()) {
                    if &self.cached_path[cr.clone()] == comp {
                        cur = *id;
                        new.push((r, cur));
                        continue;
                    }
                }
                same = false;
            }
            cur = self.child(cur, comp).ok_or_else(missing)?;
            // A pending hardlink is never a directory.
            if cur & PENDING != 0 || !self.tree.meta(cur).is_dir() {
                return Err(not_dir());
            }
            new.push((r, cur));
        }
        self.cached_path.clear();
        self.cached_path.extend_from_slice(prefix);
        self.resolved = std::mem::replace(&mut self.cached, new);
        Ok(cur)
    }

    /// Adds the entry `name` -> `id` to `dir`, which does not have it yet.
    fn insert(&mut self, dir: InodeId, name: &[u8], id: InodeId, hardlink: bool) -> Result<(), String> {
        let t = &self.tree;
        let in_order = match t.entries(dir).last() {
            Some(last) => t.name(last) < name,
            None => true,
        };
        if in_order {
            // Appends: no entries move.
            return self.tree.push_entry(dir, name, id, hardlink).map_err(too_large);
        }
        validate_name(name).map_err(|e| e.to_string())?;
        let entry = self.tree.new_entry(name, id, hardlink).map_err(too_large)?;
        self.late.entry(dir).or_default().insert(name.to_vec(), entry);
        Ok(())
    }

    /// Builds the inode of a (non-hardlink) line, its data and xattrs in
    /// the tree's arenas.
    fn inode(
        &mut self,
        path: &[u8],
        f: &[&[u8]; 11],
        mode: u32,
        ftype: FileType,
        xattr_text: &[u8],
    ) -> Result<FlatInode, String> {
        let at = |e: String| format!("{}: {e}", show(path));
        let size = dec_u64(f, SIZE)?;
        let mut meta = Meta {
            mode,
            nlink: dec_u32(f, NLINK)?,
            uid: dec_u32(f, UID)?,
            gid: dec_u32(f, GID)?,
            ..Meta::default()
        };
        // The image holds a 32-bit device number, as the reference's does.
        let rdev = dec_u64(f, RDEV)?;
        meta.mtime = mtime(f)?;
        let mut payload_buf = std::mem::take(&mut self.s.payload);
        let mut content_buf = std::mem::take(&mut self.s.content);
        let r = self.inode_data(
            f,
            meta,
            size,
            rdev,
            ftype,
            xattr_text,
            &mut payload_buf,
            &mut content_buf,
        );
        self.s.payload = payload_buf;
        self.s.content = content_buf;
        r.map_err(|e| match e {
            Located::Here(e) => e,
            Located::At(e) => at(e),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn inode_data(
        &mut self,
        f: &[&[u8]; 11],
        mut meta: Meta,
        size: u64,
        rdev: u64,
        ftype: FileType,
        xattr_text: &[u8],
        payload_buf: &mut Vec<u8>,
        content_buf: &mut Vec<u8>,
    ) -> Result<FlatInode, Located> {
        use Located::{At, Here};
        let payload = optional_field(f, PAYLOAD, payload_buf, self.escapes).map_err(Here)?;
        let content = optional_field(f, CONTENT, content_buf, self.escapes).map_err(Here)?;
        if let Some(c) = content {
            if c.len() as u64 != size {
                return Err(At(format!("CONTENT is {} bytes but SIZE is {size}", c.len())));
            }
        }
        let mut digest_buf = Vec::new();
        let digest = digest(f, &mut digest_buf, self.escapes).map_err(Here)?;

        match ftype {
            FileType::CharDevice | FileType::BlockDevice => meta.rdev = rdev as u32,
            _ if self.strict && rdev != 0 => return Err(At(format!("RDEV is {rdev} but a {ftype} has none"))),
            _ => {}
        }

        let (payload, content) = if ftype == FileType::Symlink {
            let target = match payload {
                Some(t) if !t.is_empty() => t,
                _ => return Err(At("a symlink needs a target in PAYLOAD".into())),
            };
            if target.len() > MAX_PAYLOAD_LEN {
                return Err(At(format!(
                    "symlink target is {} bytes, longer than {MAX_PAYLOAD_LEN}",
                    target.len()
                )));
            }
            if target.contains(&0) {
                return Err(At("symlink target contains a NUL byte".into()));
            }
            if self.strict {
                if size != target.len() as u64 {
                    return Err(At(format!(
                        "SIZE is {size} but the symlink target is {} bytes",
                        target.len()
                    )));
                }
                if content.is_some_and(|c| !c.is_empty()) {
                    return Err(At("a symlink cannot have CONTENT".into()));
                }
            }
            // A symlink's size is its target's length, whatever SIZE says;
            // any content is dropped.
            meta.size = target.len() as u64;
            (Some(target), None)
        } else {
            meta.size = size;
            if let Some(p) = payload {
                if p.len() > MAX_PAYLOAD_LEN {
                    return Err(At(format!(
                        "PAYLOAD is {} bytes, longer than {MAX_PAYLOAD_LEN}",
                        p.len()
                    )));
                }
                if p.contains(&0) {
                    return Err(At("PAYLOAD contains a NUL byte".into()));
                }
            }
            if let Some(c) = content {
                if c.len() > MAX_INLINE_CONTENT {
                    return Err(At(format!(
                        "inline CONTENT is {} bytes, more than {MAX_INLINE_CONTENT}",
                        c.len()
                    )));
                }
            }
            // An empty payload means nothing (the reference ignores it), and
            // empty content is no content (size 0), as in the reference.
            let content = content.filter(|c| !c.is_empty());
            if ftype == FileType::Regular && size > 0 && content.is_none() && chunk_count(size) > MAX_EXTERNAL_CHUNKS {
                // The reference accepts this line and fails when writing.
                return Err(At(format!("file of {size} bytes is too large for the image format")));
            }
            (payload.filter(|p| !p.is_empty()), content)
        };

        self.xattrs(xattr_text)?;

        let mut inode = FlatInode::new(meta);
        let t = &mut self.tree;
        if let Some(p) = payload {
            inode.payload = t.push_payload(p).map_err(|e| Here(too_large(e)))?;
        }
        if let Some(c) = content {
            inode.content = t.push_data(c).map_err(|e| Here(too_large(e)))?;
        }
        if let Some(d) = digest {
            inode.digest = t.push_digest(d).map_err(|e| Here(too_large(e)))?;
        }
        let mut ids = std::mem::take(&mut self.s.ids);
        ids.clear();
        for &slot in self.s.slots.iter().flatten() {
            let (k, sep, end) = self.s.xattr_ranges[slot];
            let b = &self.s.xattr_bytes;
            ids.push(
                self.tree
                    .xattrs
                    .intern(&b[k..sep], &b[sep..end])
                    .map_err(|e| Here(too_large(e)))?,
            );
        }
        let r = self.tree.push_xattr_list(&ids);
        self.s.ids = ids;
        (inode.xattrs, inode.n_xattrs) = r.map_err(|e| Here(too_large(e)))?;
        Ok(inode)
    }

    /// Parses the xattrs of a line into `self.s.slots`: each name once, its
    /// last value, in the order [`crate::Inode::set_xattrs`] keeps, within
    /// the budget of an inode.
    fn xattrs(&mut self, xattr_text: &[u8]) -> Result<(), Located> {
        use Located::At;
        let s = &mut self.s;
        s.xattr_bytes.clear();
        s.xattr_ranges.clear();
        s.slots.clear();
        if xattr_text.is_empty() {
            return Ok(());
        }
        let mut rest = xattr_text;
        let mut total = 0usize;
        let append = |text: &[u8], out: &mut Vec<u8>| {
            if self.escapes {
                unescape_append(text, out)
            } else {
                out.extend_from_slice(text);
                Ok(())
            }
        };
        while !rest.is_empty() {
            let x = next_field(&mut rest);
            let eq = memchr::memchr(b'=', x).ok_or_else(|| At(format!("xattr '{}' has no '='", show(x))))?;
            let k = s.xattr_bytes.len();
            append(&x[..eq], &mut s.xattr_bytes).map_err(|e| At(format!("xattr name: {e}")))?;
            let sep = s.xattr_bytes.len();
            append(&x[eq + 1..], &mut s.xattr_bytes)
                .map_err(|e| At(format!("xattr {}: {e}", show(&s.xattr_bytes[k..sep]))))?;
            let end = s.xattr_bytes.len();
            total += end - k;
            if total > MAX_XATTR_BYTES {
                return Err(At(format!(
                    "too many xattrs: more than {MAX_XATTR_BYTES} bytes of names and values"
                )));
            }
            s.xattr_ranges.push((k, sep, end));
        }
        // Set in order: a repeated name replaces the earlier value.
        if let Err(e) = set_xattrs(s, EXTERNAL_XATTR_BUDGET) {
            // Name the xattr when it is wrong by itself.
            let b = &s.xattr_bytes;
            let alone = |&(k, sep, end): &(usize, usize, usize)| check_xattr(&b[k..sep], &b[sep..end]).err();
            return Err(At(
                match s.xattr_ranges.iter().find(|x| alone(x).as_ref() == Some(&e)) {
                    Some(&(k, sep, _)) => format!("xattr '{}': {e}", escaped(&b[k..sep], Escape::Xattr)),
                    None => e.to_string(),
                },
            ));
        }
        Ok(())
    }

    fn finish(mut self) -> Result<FlatTree, DumpError> {
        if !self.have_root {
            return Err(DumpError {
                line: 0,
                reason: "empty dump: no root directory".into(),
            });
        }
        let mut tree = std::mem::replace(&mut self.tree, FlatTree::new(Meta::default()));
        // Merge the out-of-order entries into their directories.
        for (dir, late) in std::mem::take(&mut self.late) {
            let entries = std::mem::take(tree.entries_mut(dir));
            let mut merged = Vec::with_capacity(entries.len() + late.len());
            let mut a = entries.into_iter().peekable();
            let mut b = late.into_values().peekable();
            loop {
                let take_a = match (a.peek(), b.peek()) {
                    (Some(x), Some(y)) => tree.name(x) < tree.name(y),
                    (Some(_), None) => true,
                    (None, Some(_)) => false,
                    (None, None) => break,
                };
                merged.extend(if take_a { a.next() } else { b.next() });
            }
            *tree.entries_mut(dir) = merged;
        }
        self.resolve_hardlinks(&mut tree)?;
        Ok(tree)
    }

    /// Points every hardlink entry at its target's inode. A target may be
    /// another hardlink (followed to its end), never a directory, never
    /// the link itself or a cycle of links.
    fn resolve_hardlinks(&self, tree: &mut FlatTree) -> Result<(), DumpError> {
        let mut state = vec![Resolution::Unvisited; self.fixups.len()];
        let mut chain = Vec::new();
        for start in 0..self.fixups.len() {
            chain.clear();
            let mut cur = start;
            let target = loop {
                let fx = &self.fixups[cur];
                let err = |what: String| DumpError {
                    line: fx.line,
                    reason: format!("{}: {what}", show(&fx.path)),
                };
                match state[cur] {
                    Resolution::Done(id) => break id,
                    Resolution::InProgress => {
                        return Err(err(format!(
                            "hardlink to {} is part of a cycle of hardlinks",
                            show(&fx.target)
                        )))
                    }
                    Resolution::Unvisited => {}
                }
                state[cur] = Resolution::InProgress;
                chain.push(cur);
                let id = lookup(tree, &fx.target)
                    .ok_or_else(|| err(format!("hardlink target {} is not in the dump", show(&fx.target))))?;
                if id & PENDING != 0 {
                    let next = (id & !PENDING) as usize;
                    if next == cur {
                        return Err(err("hardlink to itself".into()));
                    }
                    cur = next;
                    continue;
                }
                if tree.meta(id).is_dir() {
                    return Err(err(format!(
                        "hardlink target {} is a directory; directories cannot be hardlinked",
                        show(&fx.target)
                    )));
                }
                break id;
            };
            for &c in &chain {
                state[c] = Resolution::Done(target);
            }
        }
        for (fx, st) in self.fixups.iter().zip(&state) {
            let Resolution::Done(id) = *st else {
                unreachable!("every hardlink was resolved")
            };
            let name = fx.path.rsplit(|&c| c == b'/').next().unwrap_or_default();
            let i = find_entry(tree, fx.dir, name).ok_or_else(|| DumpError {
                line: fx.line,
                reason: format!("{}: internal error: hardlink entry not found", show(&fx.path)),
            })?;
            tree.entries_mut(fx.dir)[i].inode = id;
        }
        Ok(())
    }
}

/// Where an error of an inode's line belongs: the message as is, or after
/// the path.
enum Located {
    Here(String),
    At(String),
}

/// [`crate::Inode::set_xattrs`] on the line's parsed xattrs: each name
/// once, its last value, moved to the end when repeated, stopping at the
/// first error. Repeated names are found through an index once there are
/// many, so a hostile line costs linear time.
fn set_xattrs(s: &mut Scratch, budget: usize) -> Result<(), TreeError> {
    // Below this many xattrs a linear scan beats hashing.
    const INDEX_FROM: usize = 16;
    let b = &s.xattr_bytes;
    let key = |i: usize| {
        let (k, sep, _) = s.xattr_ranges[i];
        &b[k..sep]
    };
    let mut total = 0usize;
    let mut index: Option<rustc_hash::FxHashMap<&[u8], usize>> = None;
    for (i, &(k, sep, end)) in s.xattr_ranges.iter().enumerate() {
        let (kb, vb) = (&b[k..sep], &b[sep..end]);
        check_xattr(kb, vb)?;
        if index.is_none() && s.slots.len() >= INDEX_FROM {
            index = Some(
                s.slots
                    .iter()
                    .enumerate()
                    .filter_map(|(pos, slot)| Some((key((*slot)?), pos)))
                    .collect(),
            );
        }
        let old = match &index {
            Some(map) => map.get(kb).copied(),
            None => s.slots.iter().position(|slot| slot.is_some_and(|j| key(j) == kb)),
        };
        if let Some(old) = old {
            if let Some(j) = s.slots[old].take() {
                let (ok, osep, oend) = s.xattr_ranges[j];
                total -= xattr_entry_budget(osep - ok, oend - osep);
            }
        }
        let used = total + xattr_entry_budget(kb.len(), vb.len()) + XATTR_HEADER_BUDGET;
        if used > budget {
            return Err(TreeError::XattrsTooLarge { used, budget });
        }
        total = used - XATTR_HEADER_BUDGET;
        if let Some(map) = &mut index {
            map.insert(kb, s.slots.len());
        }
        s.slots.push(Some(i));
    }
    Ok(())
}

/// The index of `name` among `dir`'s (sorted) entries.
fn find_entry(tree: &FlatTree, dir: InodeId, name: &[u8]) -> Option<usize> {
    tree.entries(dir).binary_search_by(|e| tree.name(e).cmp(name)).ok()
}

/// Numbers the inodes in the order their primary entries come in a
/// depth-first walk in name order, the order `print` writes them in: the
/// tree of a dump then does not depend on the order of its lines, and
/// printing and parsing it again gives the same tree. Dumps usually come in
/// that order already, and then nothing moves.
fn renumber(tree: &mut Tree) {
    const UNSEEN: InodeId = InodeId::MAX;
    let n = tree.inodes.len();
    let mut new_id = vec![UNSEEN; n];
    let mut order: Vec<InodeId> = Vec::with_capacity(n);
    let mut visit = |id: InodeId| {
        let slot = &mut new_id[id as usize];
        if *slot == UNSEEN {
            *slot = order.len() as InodeId;
            order.push(id);
        }
    };
    visit(ROOT);
    // (directory, index of its next entry); no recursion, for deep trees.
    let mut stack = vec![(ROOT, 0usize)];
    while let Some(top) = stack.last_mut() {
        let (dir, i) = *top;
        let Some(e) = tree.inode(dir).entries.get(i) else {
            stack.pop();
            continue;
        };
        top.1 += 1;
        if !e.hardlink {
            visit(e.inode);
            if tree.inode(e.inode).is_dir() {
                stack.push((e.inode, 0));
            }
        }
    }
    // Every inode the parser made has a primary entry, so `order` holds
    // them all.
    debug_assert_eq!(order.len(), n);
    if order.iter().enumerate().all(|(i, &id)| i == id as usize) {
        return;
    }
    let mut old = std::mem::take(&mut tree.inodes);
    tree.inodes = order.iter().map(|&id| std::mem::take(&mut old[id as usize])).collect();
    for inode in &mut tree.inodes {
        for e in &mut inode.entries {
            e.inode = new_id[e.inode as usize];
        }
    }
}

/// Resolves a path during hardlink resolution, where entries may still be
/// pending hardlinks (never followed as directories). Empty components are
/// skipped, so `""` and `/` name the root.
fn lookup(tree: &FlatTree, path: &[u8]) -> Option<InodeId> {
    let mut cur = ROOT;
    for comp in path.split(|&c| c == b'/').filter(|c| !c.is_empty()) {
        if cur & PENDING != 0 {
            return None;
        }
        if !tree.meta(cur).is_dir() {
            return None;
        }
        let i = find_entry(tree, cur, comp)?;
        cur = tree.entries(cur)[i].inode;
    }
    Some(cur)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{Inode, Xattr, S_IFBLK, S_IFCHR, S_IFDIR, S_IFREG};

    const ROOT_LINE: &str = "/ 4096 40755 2 0 0 0 0.0 - - -\n";

    fn parse_str(s: &str, strict: bool) -> Result<Tree, DumpError> {
        parse(s.as_bytes(), ParseOptions { strict })
    }

    fn ok(s: &str) -> Tree {
        let t = parse_str(s, true).unwrap_or_else(|e| panic!("strict: {e}"));
        assert_eq!(parse_str(s, false).unwrap(), t);
        t
    }

    /// Fails in both modes, on `line`, with a reason containing `what`.
    fn fails(s: &str, line: usize, what: &str) {
        for strict in [false, true] {
            let e = parse_str(s, strict).expect_err(s);
            assert_eq!(e.line, line, "{e} (strict {strict})");
            assert!(e.reason.contains(what), "{e:?} should mention {what:?}");
        }
    }

    fn with_root(rest: &str) -> String {
        format!("{ROOT_LINE}{rest}")
    }

    #[test]
    fn basic_fields() {
        let d = "35d02f81325122d77ec1d11baba655bc9bf8a891ab26119a41c50fa03ddfb408";
        let t = ok(&with_root(&format!(
            "/a\\x20dir 27 40700 2 1000 1001 0 1694598852.869646118 - - - user.x=1\n\
             /a\\x20dir/file 259 100644 1 5 6 0 1.2 35/d02f - {d} security.selinux=a\\x00 user.k\\x3d=v=w\n\
             /blk 0 60600 1 0 0 2049 0.0 - - -\n\
             /inline 10 100644 1 0 0 0 0.0 - some-text\\n -\n"
        )));
        let dir = t.inode(t.lookup_path(b"/a dir").unwrap());
        assert_eq!(dir.mode, S_IFDIR | 0o700);
        assert_eq!((dir.nlink, dir.uid, dir.gid, dir.size), (2, 1000, 1001, 27));
        assert_eq!(
            dir.mtime,
            Timespec {
                sec: 1694598852,
                nsec: 869646118
            }
        );
        assert_eq!(
            dir.xattrs,
            vec![Xattr {
                key: b"user.x".to_vec(),
                value: b"1".to_vec()
            }]
        );
        let f = t.inode(t.lookup_path(b"/a dir/file").unwrap());
        assert_eq!(f.size, 259);
        assert_eq!(f.payload.as_deref(), Some(&b"35/d02f"[..]));
        assert_eq!(hex::encode(f.digest.unwrap()), d);
        assert_eq!(f.xattr(b"security.selinux"), Some(&b"a\0"[..]));
        assert_eq!(f.xattr(b"user.k="), Some(&b"v=w"[..]));
        let b = t.inode(t.lookup_path(b"/blk").unwrap());
        assert_eq!((b.mode, b.rdev), (S_IFBLK | 0o600, 2049));
        let i = t.inode(t.lookup_path(b"/inline").unwrap());
        assert_eq!(i.content.as_deref(), Some(&b"some-text\n"[..]));
        // Lenient about the symlink size field.
        let t = parse_str(&with_root("/link 99 120777 1 0 0 0 0.0 target - -\n"), false).unwrap();
        let l = t.inode(t.lookup_path(b"/link").unwrap());
        assert_eq!((l.size, l.payload.as_deref()), (6, Some(&b"target"[..])));
    }

    #[test]
    fn optional_fields() {
        let t = ok(&with_root(
            "/dash 1 100644 1 0 0 0 0.0 \\x2d \\x2d -\n/empty 0 100644 1 0 0 0 0.0 - - -\n/z 0 100644 1 0 0 0 0.0  - -\n",
        ));
        let d = t.inode(t.lookup_path(b"/dash").unwrap());
        assert_eq!(d.payload.as_deref(), Some(&b"-"[..]));
        assert_eq!(d.content.as_deref(), Some(&b"-"[..]));
        let e = t.inode(t.lookup_path(b"/empty").unwrap());
        assert_eq!((e.payload.as_ref(), e.content.as_ref(), e.digest), (None, None, None));
        // An empty PAYLOAD field is no payload.
        assert_eq!(t.inode(t.lookup_path(b"/z").unwrap()).payload, None);
    }

    #[test]
    fn trailing_space_and_missing_fields() {
        ok(&with_root("/a 0 100644 1 0 0 0 0.0 - - - \n"));
        ok(&with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a=b \n"));
        fails(&with_root("/a 0 100644 1 0 0 0 0.0 - - -  user.a=b\n"), 2, "has no '='");
        fails(&with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a\n"), 2, "has no '='");
        // Missing optional fields at the end are absent.
        let t = ok(&with_root("/a 0 100644 1 0 0 0 0.0\n"));
        assert_eq!(t.inode(1), &Inode::new(S_IFREG | 0o644));
        // A missing CONTENT is empty, which must match SIZE.
        fails(&with_root("/a 1 100644 1 0 0 0 0.0 x\n"), 2, "CONTENT is 0 bytes");
        let t = parse_str(&with_root("/l 0 120777 1 0 0 0 0.0 x\n"), false).unwrap();
        assert_eq!((t.inode(1).payload.as_deref(), t.inode(1).size), (Some(&b"x"[..]), 1));
        fails(&with_root("/a 0 100644 1 0 0 0\n"), 2, "MTIME");
        fails(&with_root("/a 0 100644\n"), 2, "NLINK");
    }

    #[test]
    fn numbers() {
        let t = ok(&with_root(
            "/c 0 20644 4294967295 4294967295 4294967295 18446744073709551615 -1.4294967297 - - -\n",
        ));
        let c = t.inode(t.lookup_path(b"/c").unwrap());
        assert_eq!(
            (c.nlink, c.uid, c.gid, c.rdev),
            (u32::MAX, u32::MAX, u32::MAX, u32::MAX)
        );
        assert_eq!(c.mtime, Timespec { sec: -1, nsec: 1 });
        let t = ok(&with_root("/c 0 20644 1 0 0 0 18446744073709551615.0 - - -\n"));
        assert_eq!(t.inode(1).mtime.sec, -1);
        for bad in [
            "/c 0 20644 4294967296 0 0 0 0.0 - - -",
            "/c 0 20644 1 -1 0 0 0.0 - - -",
            "/c 0 20644 1 0 +1 0 0.0 - - -",
            "/c 0 20644 1 0 x 0 0.0 - - -",
            // The reference misses these two when UID is not 0.
            "/c 0 20644 1 5 x 0 0.0 - - -",
            "/c 0 20644 1 5 0 x 0.0 - - -",
            "/c 0 20644 1 0 0 1x 0.0 - - -",
            "/c 0 20644 1 0 0 18446744073709551616 0.0 - - -",
            "/c x 20644 1 0 0 0 0.0 - - -",
            "/c 0 20648 1 0 0 0 0.0 - - -",
            "/c 0 @ 1 0 0 0 0.0 - - -",
            "/c 0 20644 1 0 0 0 0 - - -",
            "/c 0 20644 1 0 0 0 .0 - - -",
            "/c 0 20644 1 0 0 0 1. - - -",
            "/c 0 20644 1 0 0 0 1.-1 - - -",
        ] {
            let e = parse_str(&with_root(&format!("{bad}\n")), false).expect_err(bad);
            assert_eq!(e.line, 2);
            assert!(e.reason.contains("invalid"), "{e}");
        }
    }

    #[test]
    fn modes() {
        fails(&with_root("/x 0 644 1 0 0 0 0.0 - - -\n"), 2, "unknown file type");
        fails(&with_root("/x 0 170644 1 0 0 0 0.0 - - -\n"), 2, "unknown file type");
        // Bits above the file type are kept (the image keeps 16 of them).
        let t = ok(&with_root("/x 1 20120777 1 0 0 0 0.0 a - -\n"));
        assert_eq!(t.inode(1).mode, 0o20120777);
        assert_eq!(t.inode(1).file_type(), Some(FileType::Symlink));
    }

    #[test]
    fn root_rules() {
        fails("/a 0 100644 1 0 0 0 0.0 - - -\n", 1, "first line must be the root");
        fails("/ 0 100644 1 0 0 0 0.0 - - -\n", 1, "must be a directory");
        fails("/ 0 @40755 1 0 0 0 0.0 - - -\n", 1, "cannot be a hardlink");
        fails(&with_root(ROOT_LINE), 2, "root");
        fails("", 0, "empty");
        fails("\n", 1, "empty path");
        fails(&with_root("\n"), 2, "empty path");
    }

    #[test]
    fn path_rules() {
        fails(&with_root("/a/b 0 100644 1 0 0 0 0.0 - - -\n"), 2, "missing");
        fails(
            &with_root("/f 0 100644 1 0 0 0 0.0 - - -\n/f/b 0 100644 1 0 0 0 0.0 - - -\n"),
            3,
            "not a directory",
        );
        fails(&with_root("/. 0 100644 1 0 0 0 0.0 - - -\n"), 2, "'.'");
        fails(
            &with_root("/d 0 40755 1 0 0 0 0.0 - - -\n/d/.. 0 40755 1 0 0 0 0.0 - - -\n"),
            3,
            "'..'",
        );
        fails(&with_root("// 0 40755 1 0 0 0 0.0 - - -\n"), 2, "empty file name");
        fails(&with_root("/d/ 0 40755 1 0 0 0 0.0 - - -\n"), 2, "missing");
        fails(
            &with_root("/a 0 100644 1 0 0 0 0.0 - - -\n/a 0 100644 1 0 0 0 0.0 - - -\n"),
            3,
            "already",
        );
        fails(&with_root("/a\\x00b 0 100644 1 0 0 0 0.0 - - -\n"), 2, "NUL");
        fails(
            &with_root("/a\0b 0 100644 1 0 0 0 0.0 - - -\n"),
            2,
            "NUL byte at column 3",
        );
        fails(
            &with_root(&format!("/{} 0 100644 1 0 0 0 0.0 - - -\n", "n".repeat(256))),
            2,
            "255",
        );
        ok(&with_root(&format!(
            "/{} 0 100644 1 0 0 0 0.0 - - -\n",
            "n".repeat(255)
        )));
        // Repeated slashes and a missing leading slash are accepted.
        let t = ok(&with_root(
            "/d 0 40755 1 0 0 0 0.0 - - -\n//d//x 0 100644 1 0 0 0 0.0 - - -\nd/y 0 100644 1 0 0 0 0.0 - - -\n",
        ));
        assert!(t.lookup_path(b"/d/x").is_some() && t.lookup_path(b"/d/y").is_some());
    }

    #[test]
    fn escapes() {
        let t = ok(&with_root("/a\\\\\\n\\r\\t\\xFf\\x7e 0 100644 1 0 0 0 0.0 - - -\n"));
        assert_eq!(t.root().entries[0].name, b"a\\\n\r\t\xff~");
        fails(&with_root("/a\\ 0 100644 1 0 0 0 0.0 - - -\n"), 2, "end of the field");
        fails(&with_root("/a\\x4 0 100644 1 0 0 0 0.0 - - -\n"), 2, "two hex digits");
        fails(
            &with_root("/a\\x4g 0 100644 1 0 0 0 0.0 - - -\n"),
            2,
            "invalid hex escape",
        );
        fails(&with_root("/a\\q 0 100644 1 0 0 0 0.0 - - -\n"), 2, "unknown escape");
        fails(
            &with_root("/a 0 100644 1 0 0 0 0.0 - - - user.a\\q=b\n"),
            2,
            "xattr name",
        );
    }

    #[test]
    fn content_and_payload() {
        fails(
            &with_root("/a 3 100644 1 0 0 0 0.0 - ab -\n"),
            2,
            "CONTENT is 2 bytes but SIZE is 3",
        );
        let big = "x".repeat(5001);
        fails(
            &with_root(&format!("/a 5001 100644 1 0 0 0 0.0 - {big} -\n")),
            2,
            "more than 5000",
        );
        ok(&with_root(&format!(
            "/a 5000 100644 1 0 0 0 0.0 - {} -\n",
            &big[..5000]
        )));
        let p = "p".repeat(4096);
        fails(
            &with_root(&format!("/a 1 100644 1 0 0 0 0.0 {p} - -\n")),
            2,
            "longer than 4095",
        );
        ok(&with_root(&format!("/a 1 100644 1 0 0 0 0.0 {} - -\n", &p[..4095])));
        fails(&with_root("/a 1 100644 1 0 0 0 0.0 a\\x00 - -\n"), 2, "NUL");
        // Content may hold any byte.
        let t = ok(&with_root("/a 2 100644 1 0 0 0 0.0 - \\x00\\x20 -\n"));
        assert_eq!(t.inode(1).content.as_deref(), Some(&b"\0 "[..]));
        // Too big for an external file in the image.
        fails(
            &with_root("/a 9500000000000000 100644 1 0 0 0 0.0 - - -\n"),
            2,
            "too large",
        );
        ok(&with_root(&format!("/a {} 100644 1 0 0 0 0.0 - - -\n", 1u64 << 53)));
        fails(
            &with_root(&format!("/a {} 100644 1 0 0 0 0.0 - - -\n", (1u64 << 53) + 1)),
            2,
            "too large",
        );
    }

    #[test]
    fn digest_decoding() {
        let hex = "00ff1a2B3c4D5e6F7890abcdefABCDEF0123456789aAbBcCdDeEfF0011223344";
        assert_eq!(decode_digest(hex.as_bytes()).map(hex::encode), Some(hex.to_lowercase()));
        for bad in [
            b"0g", b"g0", b" 0", b"0:", b"0@", b"0G", b"0`", b"0/", b"\xff0", b"0\x80",
        ] {
            let mut t = hex.to_string().into_bytes();
            t[10..12].copy_from_slice(bad);
            assert_eq!(decode_digest(&t), None, "{bad:?}");
        }
        assert_eq!(decode_digest(&hex.as_bytes()[..62]), None);
    }

    #[test]
    fn digests() {
        let d = "AB".repeat(32);
        let t = ok(&with_root(&format!("/a 0 100644 1 0 0 0 0.0 - - {d}\n")));
        assert_eq!(t.inode(1).digest, Some([0xab; 32]));
        for bad in ["ab", &"ab".repeat(33), &"zz".repeat(32), "\\x00"] {
            let s = with_root(&format!("/a 0 100644 1 0 0 0 0.0 - - {bad}\n"));
            let e = parse_str(&s, false).expect_err(bad);
            assert!(e.line == 2 && e.reason.contains("DIGEST"), "{e}");
        }
    }

    #[test]
    fn symlinks() {
        fails(&with_root("/l 0 120777 1 0 0 0 0.0 - - -\n"), 2, "needs a target");
        fails(&with_root("/l 0 120777 1 0 0 0 0.0  - -\n"), 2, "needs a target");
        let long = "a".repeat(4096);
        fails(
            &with_root(&format!("/l 4096 120777 1 0 0 0 0.0 {long} - -\n")),
            2,
            "longer than 4095",
        );
        ok(&with_root(&format!(
            "/l 4095 120777 1 0 0 0 0.0 {} - -\n",
            &long[..4095]
        )));
        fails(&with_root("/l 3 120777 1 0 0 0 0.0 a\\x00b - -\n"), 2, "NUL");
        // Strict only.
        for (s, what) in [
            ("/l 2 120777 1 0 0 0 0.0 abc - -\n", "SIZE is 2"),
            ("/l 3 120777 1 0 0 0 0.0 abc abc -\n", "cannot have CONTENT"),
            ("/l 3 120777 1 0 0 5 0.0 abc - -\n", "RDEV"),
        ] {
            let s = with_root(s);
            let t = parse_str(&s, false).unwrap();
            let l = t.inode(1);
            assert_eq!((l.size, l.content.as_ref(), l.rdev), (3, None, 0));
            let e = parse_str(&s, true).unwrap_err();
            assert!(e.line == 2 && e.reason.contains(what), "{e}");
        }
    }

    #[test]
    fn rdev() {
        let s = with_root("/f 0 100644 1 0 0 7 0.0 - - -\n/c 0 20644 1 0 0 4294967302 0.0 - - -\n");
        let t = parse_str(&s, false).unwrap();
        assert_eq!(t.inode(t.lookup_path(b"/f").unwrap()).rdev, 0);
        assert_eq!(t.inode(t.lookup_path(b"/c").unwrap()).rdev, 6);
        assert!(parse_str(&s, true).unwrap_err().reason.contains("RDEV is 7"));
    }

    #[test]
    fn no_trailing_newline() {
        let s = format!("{ROOT_LINE}/a 0 100644 1 0 0 0 0.0 - - -");
        let t = parse_str(&s, false).unwrap();
        assert!(t.lookup_path(b"/a").is_some());
        let e = parse_str(&s, true).unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.reason.contains("newline"));
    }

    #[test]
    fn xattrs() {
        let t = ok(&with_root(
            "/a 0 100644 1 0 0 0 0.0 - - - user.b=1 user.a=2 user.b=3 user.e=\n",
        ));
        let keys: Vec<_> = t
            .inode(1)
            .xattrs
            .iter()
            .map(|x| (x.key.clone(), x.value.clone()))
            .collect();
        assert_eq!(
            keys,
            vec![
                (b"user.a".to_vec(), b"2".to_vec()),
                (b"user.b".to_vec(), b"3".to_vec()),
                (b"user.e".to_vec(), vec![])
            ]
        );
        fails(&with_root("/a 0 100644 1 0 0 0 0.0 - - - =v\n"), 2, "empty xattr name");
        fails(&with_root("/a 0 100644 1 0 0 0 0.0 - - - a\\x00b=v\n"), 2, "NUL");
        let long = "k".repeat(256);
        fails(
            &with_root(&format!("/a 0 100644 1 0 0 0 0.0 - - - {long}=v\n")),
            2,
            "longer than 255",
        );
        let many: String = (0..3000).map(|i| format!(" user.{i:05}=0123456789")).collect();
        fails(
            &with_root(&format!("/a 0 100644 1 0 0 0 0.0 - - -{many}\n")),
            2,
            "more than the 32767",
        );
        let huge: String = (0..700).map(|i| format!(" user.{i:05}={}", "x".repeat(90))).collect();
        fails(
            &with_root(&format!("/a 0 100644 1 0 0 0 0.0 - - -{huge}\n")),
            2,
            "too many xattrs",
        );
        let big = "v".repeat(40000);
        fails(
            &with_root(&format!("/a 0 100644 1 0 0 0 0.0 - - - user.a={big}\n")),
            2,
            "more than",
        );
    }

    #[test]
    fn set_xattrs_matches_set_xattr() {
        // Many keys (past the point where the helper indexes them), with
        // repeats, ending in a budget failure.
        let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for i in 0..400u32 {
            let k = format!("user.k{}", i % 37).into_bytes();
            pairs.push((k, vec![b'v'; (i as usize * 7) % 300]));
        }
        for n in [0, 1, 5, 16, 17, 40, 100, 400] {
            for budget in [EXTERNAL_XATTR_BUDGET, 2000, 30] {
                let mut a = Inode::new(S_IFREG);
                a.set_xattr(b"user.k3", b"pre", usize::MAX).unwrap();
                let mut b = a.clone();
                let ra = pairs[..n].iter().try_for_each(|(k, v)| a.set_xattr(k, v, budget));
                let rb = b.set_xattrs(pairs[..n].iter().map(|(k, v)| (k, v)), budget);
                assert_eq!(ra, rb, "n={n} budget={budget}");
                assert_eq!(a.xattrs, b.xattrs, "n={n} budget={budget}");
            }
        }
        let mut a = Inode::new(S_IFREG);
        let bad = [(&b"user.a"[..], &b"1"[..]), (b"", b"2"), (b"user.b", b"3")];
        assert_eq!(a.set_xattrs(bad, usize::MAX), Err(crate::TreeError::EmptyXattrName));
        assert_eq!(a.xattrs.len(), 1);
    }

    #[test]
    fn hardlinks() {
        // Forward and backward references, a chain through another link,
        // and the target's nlink kept from its own line.
        let t = ok(&with_root(
            "/a 0 @100644 1 0 0 0 0.0 /d/f - -\n\
             /b 0 @120777 9 9 9 9 garbage /a - - garbage\n\
             /d 0 40755 2 0 0 0 0.0 - - -\n\
             /d/f 5 100644 3 0 0 0 0.0 - hello -\n\
             /e 0 @100644 1 0 0 0 0.0 //d//f - -\n",
        ));
        let f = t.lookup_path(b"/d/f").unwrap();
        for n in [&b"a"[..], b"b", b"e"] {
            let e = t.root().entry(n).unwrap();
            assert_eq!((e.inode, e.hardlink), (f, true));
        }
        assert!(!t.inode(t.lookup_path(b"/d").unwrap()).entries[0].hardlink);
        assert_eq!(t.inode(f).nlink, 3);
        assert_eq!(t.inodes.len(), 3);

        fails(
            &with_root("/a 0 @40755 1 0 0 0 0.0 / - -\n"),
            2,
            "directories cannot be hardlinked",
        );
        fails(
            &with_root("/d 0 40755 1 0 0 0 0.0 - - -\n/a 0 @100644 1 0 0 0 0.0 /d - -\n"),
            3,
            "is a directory",
        );
        fails(&with_root("/a 0 @100644 1 0 0 0 0.0 /a - -\n"), 2, "hardlink to itself");
        fails(&with_root("/a 0 @100644 1 0 0 0 0.0 /nope - -\n"), 2, "not in the dump");
        fails(&with_root("/a 0 @100644 1 0 0 0 0.0 - - -\n"), 2, "without a target");
        fails(
            &with_root("/a 0 @100644 1 0 0 0 0.0 /b - -\n/b 0 @100644 1 0 0 0 0.0 /a - -\n"),
            2,
            "cycle",
        );
        fails(
            &with_root("/a 0 @100644 1 0 0 0 0.0 /f - -\n/a/x 0 100644 1 0 0 0 0.0 - - -\n"),
            3,
            "not a directory",
        );
        fails(
            &with_root("/a 0 @100644 1 0 0 0 0.0 /f - -\n/a 0 100644 1 0 0 0 0.0 - - -\n"),
            3,
            "already",
        );
        // A path through a hardlink does not resolve.
        fails(
            &with_root(
                "/f 0 100644 1 0 0 0 0.0 - - -\n/a 0 @100644 1 0 0 0 0.0 /f - -\n/b 0 @100644 1 0 0 0 0.0 /a/x - -\n",
            ),
            4,
            "not in the dump",
        );
    }

    #[test]
    fn unsorted_input() {
        let mut s = String::from(ROOT_LINE);
        s.push_str("/d 0 40755 2 0 0 0 0.0 - - -\n");
        for i in (0..2000).rev() {
            s.push_str(&format!("/d/f{i:04} 0 100644 1 0 0 0 0.0 - - -\n"));
            if i % 7 == 0 {
                s.push_str(&format!("/d/h{i:04} 0 @100644 1 0 0 0 0.0 /d/f{i:04} - -\n"));
            }
        }
        s.push_str("/c 0 100644 1 0 0 0 0.0 - - -\n/a 0 @100644 1 0 0 0 0.0 /d/h0007 - -\n");
        fails(
            &format!("{s}/d/f1000 0 100644 1 0 0 0 0.0 - - -\n"),
            s.lines().count() + 1,
            "already",
        );
        let t = ok(&s);
        let d = t.inode(t.lookup_path(b"/d").unwrap());
        assert_eq!(d.entries.len(), 2000 + 286);
        assert!(d.entries.windows(2).all(|w| w[0].name < w[1].name));
        let names: Vec<_> = t.root().entries.iter().map(|e| e.name.clone()).collect();
        assert_eq!(names, vec![b"a".to_vec(), b"c".to_vec(), b"d".to_vec()]);
        assert_eq!(t.root().entries[0].inode, t.lookup_path(b"/d/f0007").unwrap());
        let h = d.entry(b"h0014").unwrap();
        assert!(h.hardlink && h.inode == t.lookup_path(b"/d/f0014").unwrap());
    }

    #[test]
    fn line_order_does_not_matter() {
        let sorted = with_root(
            "/a 0 40755 1 0 0 0 0.0 - - -\n/a/x 1 100644 2 0 0 0 0.0 - x -\n/b 0 @100644 1 0 0 0 0.0 /a/x - -\n\
             /c 0 40755 1 0 0 0 0.0 - - -\n/c/y 0 100644 1 0 0 0 0.0 - - -\n",
        );
        let shuffled = with_root(
            "/b 0 @100644 1 0 0 0 0.0 /a/x - -\n/c 0 40755 1 0 0 0 0.0 - - -\n/a 0 40755 1 0 0 0 0.0 - - -\n\
             /c/y 0 100644 1 0 0 0 0.0 - - -\n/a/x 1 100644 2 0 0 0 0.0 - x -\n",
        );
        let t = ok(&sorted);
        assert_eq!(ok(&shuffled), t);
        let names: Vec<_> = (0..t.inodes.len() as InodeId)
            .map(|id| {
                let mut path = None;
                t.walk(|p, e, i| {
                    if i == id && !e.is_some_and(|e| e.hardlink) {
                        path = Some(p.to_vec())
                    }
                });
                path.unwrap()
            })
            .collect();
        assert_eq!(names, [&b"/"[..], b"/a", b"/a/x", b"/c", b"/c/y"]);
    }

    #[test]
    fn long_lines_are_bounded() {
        let s = with_root(&format!(
            "/a 0 @100644 1 0 0 0 0.0 /b - - {}\n",
            "x".repeat(MAX_LINE_LEN)
        ));
        fails(&s, 2, "longer than");
        // Ignored fields of a hardlink line may be long, within the bound.
        ok(&with_root(&format!(
            "/b 0 100644 1 0 0 0 0.0 - - -\n/a 0 @100644 1 0 0 0 0.0 /b - - {}\n",
            "x".repeat(100_000)
        )));
    }

    #[test]
    fn device_and_types() {
        let t = ok(&with_root(
            "/c 0 20600 1 0 0 1 0.0 - - -\n/f 0 10600 1 0 0 0 0.0 - - -\n/s 0 140600 1 0 0 0 0.0 - - -\n",
        ));
        assert_eq!(t.inode(1).mode, S_IFCHR | 0o600);
        assert_eq!(t.inode(1).rdev, 1);
        assert_eq!(t.inode(2).file_type(), Some(FileType::Fifo));
        assert_eq!(t.inode(3).file_type(), Some(FileType::Socket));
    }
}
