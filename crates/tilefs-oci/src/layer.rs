//! Reading one layer: a (compressed) tar stream becomes a list of
//! [`LayerEntry`]s, and every regular file's contents an object in the
//! store, while the stream is read once.
//!
//! Layers are read independently (in parallel); only applying them
//! ([`crate::apply`]) is ordered. Names are checked here: every entry's
//! path must stay below the root (no `..`, no absolute name), and is kept
//! as its list of components.
//!
//! Limits are those of the kernel and of EROFS. A layer within them is
//! taken whole; past one, the layer is refused, naming the entry and the
//! limit:
//!
//! - a name an entry puts in the tree is at most 255 bytes (NAME_MAX, and
//!   what an EROFS directory entry holds). A whiteout `.wh.NAME` puts no
//!   name there: it is judged by the NAME it removes (up to 255 bytes, so
//!   its own name may have 259), an opaque marker by its directory;
//! - a path as a whole has no limit: PATH_MAX (4096 with its NUL) bounds
//!   one path handed to a system call, not how deep a tree nests (a tree
//!   deeper than that is built with `*at` calls, EROFS stores one name per
//!   entry, the kernel mounts it, composefs-rs takes it). Only the nesting
//!   is bounded, by the [`MAX_DEPTH`] directories the image reader takes
//!   (what a PATH_MAX path of one-byte names reaches);
//! - a symlink target is 1 to 4095 bytes, without NUL (PATH_MAX counts the
//!   NUL: symlink(2) takes no longer target);
//! - a hardlink's target is a path like an entry's;
//! - xattr names are at most 255 bytes (XATTR_NAME_MAX) and values at most
//!   65535 (EROFS's 16-bit length, one short of XATTR_SIZE_MAX): checked
//!   by [`crate::apply`], and only for the xattrs the image keeps.
//!
//! And what a small layer could make cost much more than it does is
//! bounded, since a layer is untrusted:
//!
//! - the headers of one entry (its tar headers, GNU long names, PAX
//!   records) are at most [`MAX_HEADERS`] bytes: the tar reader holds them
//!   in memory, and a compressed layer of a megabyte could declare
//!   gigabytes of them;
//! - sparse files (PAX formats 0.1 and 1.0, old GNU sparse headers) may
//!   declare holes of [`MAX_SPARSE_HOLES`] bytes in all, in one layer or
//!   over all the layers of a pull ([`ReadOptions::sparse_budget`]):
//!   holes cost nothing to send, and the store hashes a run of zeros in a
//!   few hashes per tree level and leaves it a hole. A PAX sparse file's
//!   holes are not even read ([`Ingest::import_sparse`]); an old GNU one's
//!   the tar reader expands into zeros, read at memory speed. The budget
//!   bounds what a reader of the image (a container copying the file)
//!   would meet.

use crate::OciError;
use std::io::{self, Read};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use tar::EntryType;
use tilefs_image::erofs::reader::MAX_DEPTH;
use tilefs_image::tree::{
    Timespec, MAX_NAME_LEN, MAX_PAYLOAD_LEN, RECOMMENDED_INLINE_MAX, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK,
    S_IFREG,
};
use tilefs_store::ingest::Ingest;

/// The whiteout prefix of the OCI layer format.
pub const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// The opaque-directory marker.
pub const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// How a layer blob is compressed: decided by its first bytes, whatever
/// its media type says (Docker's types say gzip for any layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression the first bytes of a stream show.
    pub fn sniff(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "uncompressed",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
}

/// Metadata a tar header gives every entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    /// Permission bits (`0o7777`), without the type.
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    /// The header's seconds, or a PAX `mtime` record's seconds and
    /// nanoseconds (composefs-rs keeps those; OCI tools rarely write them).
    pub mtime: Timespec,
    /// `SCHILY.xattr.*` records, in the order the header lists them.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// A regular file's contents.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Content {
    /// Up to [`RECOMMENDED_INLINE_MAX`] bytes, kept in the image.
    Inline(Vec<u8>),
    /// Stored in the store under this fs-verity digest.
    Object([u8; 32]),
    /// Handed to an [`Offload`] as job `id`; the caller puts the digest in
    /// place once the job is done (never kept or recorded).
    Pending(u32),
}

/// Contents read but not yet digested and stored: the reading thread
/// hands them on, so decompressing one layer and digesting and writing its
/// files run on different cores.
pub struct Job {
    pub id: u32,
    pub data: Vec<u8>,
}

/// Most bytes of headers (tar headers, GNU long names, PAX records) one
/// entry may have: a PATH_MAX-deep path of 255-byte names is half a
/// megabyte, an xattr value 64 KiB.
pub const MAX_HEADERS: u64 = 16 << 20;

/// Most bytes of holes the sparse files of a layer (or of a pull, with a
/// shared [`ReadOptions::sparse_budget`]) may declare.
pub const MAX_SPARSE_HOLES: u64 = 64 << 30;

/// Files up to this size are handed to an [`Offload`] (larger ones are
/// streamed into the store by the reading thread).
pub const OFFLOAD_MAX: u64 = 4 << 20;

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Kind {
    Dir,
    File {
        size: u64,
        content: Content,
    },
    Symlink(Vec<u8>),
    /// A second name of the file at this path (within the tree as applied
    /// so far, this layer included).
    Hardlink(Vec<Vec<u8>>),
    /// A device (`mode` carries the type), with its number in the kernel's
    /// encoding.
    Device {
        mode_type: u32,
        rdev: u32,
    },
    Fifo,
    /// `.wh.NAME`: removes NAME from the layers below.
    Whiteout,
    /// `.wh..wh..opq`: hides what the layers below hold in the directory.
    Opaque,
}

/// One entry of a layer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerEntry {
    /// Components below the root; for a whiteout, the path it removes; for
    /// an opaque marker, the directory. Empty for the root itself.
    pub path: Vec<Vec<u8>>,
    pub kind: Kind,
    pub meta: Meta,
}

impl LayerEntry {
    /// The entry's path as the layer spells it, for messages.
    pub fn display_path(&self) -> String {
        display_components(&self.path)
    }

    /// The inode type bits of the entry's mode.
    pub fn type_bits(&self) -> u32 {
        match &self.kind {
            Kind::Dir => S_IFDIR,
            Kind::File { .. } => S_IFREG,
            Kind::Symlink(_) => S_IFLNK,
            Kind::Device { mode_type, .. } => *mode_type,
            Kind::Fifo => S_IFIFO,
            Kind::Hardlink(_) | Kind::Whiteout | Kind::Opaque => 0,
        }
    }
}

/// A path for messages: components joined with `/`, bytes that are not
/// UTF-8 shown escaped.
pub fn display_components(path: &[Vec<u8>]) -> String {
    if path.is_empty() {
        return "/".to_string();
    }
    display_name(&path.join(&b'/'))
}

/// Options of layer reading.
#[derive(Clone, Copy, Default)]
pub struct ReadOptions<'a> {
    /// Checked before each entry: once true, reading stops ("interrupted").
    pub stop: Option<&'a (dyn Fn() -> bool + Sync)>,
    /// Counts the entries read, for progress displays.
    pub entries: Option<&'a AtomicU64>,
    /// Where file contents go to be digested and stored by other threads.
    pub offload: Option<&'a (dyn Fn(Job) + Sync)>,
    /// Bytes of holes sparse files may still declare, shared by the layers
    /// of a pull (without one, a layer may declare [`MAX_SPARSE_HOLES`]).
    pub sparse_budget: Option<&'a AtomicU64>,
}

/// Where a regular file's contents lie in its layer's uncompressed tar
/// stream, for lazy reads of ordinary layers ([`crate::lazy_index`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Placement {
    /// Not a file whose contents are an object (a directory, a link, a
    /// file kept inline in the image).
    None,
    /// Its `size` bytes start at this offset of the tar stream.
    At(u64),
    /// A sparse file: its pieces are spread over the stream with a map of
    /// their own, so it is read by reading the whole layer.
    WholeLayer,
}

/// Reads the tar stream `tar` (already decompressed), storing file
/// contents through `ingest`. `blob` names the layer in messages.
pub fn read_entries(
    tar: &mut dyn Read,
    blob: &str,
    ingest: &Ingest,
    opts: ReadOptions,
) -> Result<Vec<LayerEntry>, OciError> {
    read_entries_placed(tar, blob, ingest, opts).map(|(entries, _)| entries)
}

/// [`read_entries`], with each entry's [`Placement`] in the stream (the
/// two lists are as long as each other).
pub fn read_entries_placed(
    tar: &mut dyn Read,
    blob: &str,
    ingest: &Ingest,
    opts: ReadOptions,
) -> Result<(Vec<LayerEntry>, Vec<Placement>), OciError> {
    let stopped = || opts.stop.is_some_and(|stop| stop());
    let own_budget = AtomicU64::new(MAX_SPARSE_HOLES);
    // What the tar reader may still read before it hands over the next
    // entry: its headers.
    let headers = AtomicU64::new(u64::MAX);
    let mut archive = tar::Archive::new(Guarded {
        inner: tar,
        stop: opts.stop,
        headers: Some(&headers),
    });
    let mut reader = EntryReader {
        blob,
        ingest,
        opts,
        jobs: 0,
        sparse_budget: opts.sparse_budget.unwrap_or(&own_budget),
        placement: Placement::None,
    };
    let mut out = Vec::new();
    let mut placements = Vec::new();
    let mut entries = archive
        .entries()
        .map_err(|e| OciError::layer(blob, None, format!("not a tar stream: {e}")))?;
    for index in 0.. {
        if stopped() {
            return Err(OciError::Interrupted);
        }
        headers.store(MAX_HEADERS, Relaxed);
        let next = entries.next();
        headers.store(u64::MAX, Relaxed);
        let Some(entry) = next else { break };
        let read = entry
            .map_err(|e| OciError::layer(blob, None, format!("entry {}: unreadable tar header: {e}", index + 1)))
            .and_then(|mut entry| {
                let e = reader.entry(&mut entry, index)?;
                // What the entry holds past what it puts in the tree is
                // skipped here, not counted as the next one's headers.
                io::copy(&mut entry, &mut io::sink())
                    .map_err(|e| OciError::layer(blob, None, format!("entry {}: cannot read: {e}", index + 1)))?;
                Ok(e)
            });
        match read {
            Ok(Some(e)) => {
                let placed = match e.kind {
                    Kind::File {
                        content: Content::Inline(_),
                        ..
                    } => Placement::None,
                    _ => reader.placement,
                };
                out.push(e);
                placements.push(placed);
            }
            Ok(None) => {}
            Err(_) if stopped() => return Err(OciError::Interrupted),
            Err(e) => return Err(e),
        }
    }
    Ok((out, placements))
}

/// A layer's stream as the tar reader reads it: stops once `stop` says so
/// (a file of zeros that costs nothing to send may take long to hash), and
/// fails when an entry's headers pass `headers`.
pub(crate) struct Guarded<'a, R> {
    inner: R,
    stop: Option<&'a (dyn Fn() -> bool + Sync)>,
    headers: Option<&'a AtomicU64>,
}

impl<'a, R: Read> Guarded<'a, R> {
    /// `inner`, failing ("interrupted") once `stop` says so.
    pub(crate) fn stoppable(inner: R, stop: &'a (dyn Fn() -> bool + Sync)) -> Self {
        Guarded {
            inner,
            stop: Some(stop),
            headers: None,
        }
    }
}

impl<R: Read> Read for Guarded<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.stop.is_some_and(|stop| stop()) {
            return Err(io::Error::other("interrupted"));
        }
        let Some(left) = self.headers.map(|h| h.load(Relaxed)) else {
            return self.inner.read(buf);
        };
        if left == 0 {
            return Err(io::Error::other(format!(
                "the entry's headers (long names, PAX records) pass {} (the limit)",
                crate::bounded::size(MAX_HEADERS)
            )));
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if left != u64::MAX {
            self.headers.unwrap().store(left - n as u64, Relaxed);
        }
        Ok(n)
    }
}

/// What reading a layer carries from one entry to the next.
struct EntryReader<'a> {
    blob: &'a str,
    ingest: &'a Ingest<'a>,
    opts: ReadOptions<'a>,
    /// Files handed to the offload so far (the next one's job id).
    jobs: u32,
    /// Bytes of holes sparse files may still declare.
    sparse_budget: &'a AtomicU64,
    /// Where the last entry's contents lie.
    placement: Placement,
}

impl<'a> EntryReader<'a> {
    /// The entry `index` (from 0) of the layer, or `None` for one that
    /// puts nothing in the tree.
    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>, index: usize) -> Result<Option<LayerEntry>, OciError> {
        let blob = self.blob;
        let pax = pax_records(entry).map_err(|r| OciError::layer(blob, None, format!("entry {}: {r}", index + 1)))?;
        let sparse = SparseInfo::from_pax(&pax);
        // A PAX sparse file's real name is in its sparse records.
        let raw_path = match &sparse.name {
            Some(n) => n.clone(),
            None => entry.path_bytes().into_owned(),
        };
        let name = display_name(&raw_path);
        let fail = |reason: String| OciError::layer(blob, Some(&name), reason);
        self.placement = Placement::None;
        let path = split_path(&raw_path).map_err(|r| fail(r.to_string()))?;
        let meta = meta_of(entry.header(), &pax).map_err(fail)?;
        if let Some(n) = self.opts.entries {
            n.fetch_add(1, Relaxed);
        }
        match marker(&path).map_err(fail)? {
            Marker::No => {}
            Marker::Skip => return Ok(None),
            Marker::Is(kind, path) => return Ok(Some(LayerEntry { path, kind, meta })),
        }
        let etype = entry.header().entry_type();
        check_path(&path, etype == EntryType::Directory, "its path").map_err(fail)?;

        let kind = match etype {
            EntryType::Directory => Kind::Dir,
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                if path.is_empty() {
                    return Err(fail("the root is not a regular file".into()));
                }
                self.placement = match sparse.is_sparse() || etype == EntryType::GNUSparse {
                    true => Placement::WholeLayer,
                    false => Placement::At(entry.raw_file_position()),
                };
                if sparse.is_sparse() {
                    let expanded = sparse.reader(entry).map_err(fail)?;
                    let size = sparse.real_size.unwrap_or(0);
                    self.spend_holes(size, expanded.holes()).map_err(fail)?;
                    let content = match self.in_memory(size) {
                        true => self.contents(&mut self.guarded(expanded), size, &name)?,
                        // Larger ones go to the store as data and holes:
                        // the holes are neither read nor hashed byte by byte.
                        false => {
                            let SparseReader { data, pieces, .. } = expanded;
                            self.ingest
                                .import_sparse(Path::new(&name), size, &pieces, &mut self.guarded(data))
                                .map(Content::Object)
                                .map_err(|e| store_error(e, fail))?
                        }
                    };
                    Kind::File { size, content }
                } else {
                    // Old GNU sparse headers: the tar reader expands them
                    // (its size is the file's, the header's what it holds);
                    // the store hashes their zeros as holes, unwritten.
                    if etype == EntryType::GNUSparse {
                        let stored = entry.header().entry_size().unwrap_or(0);
                        self.spend_holes(entry.size(), entry.size().saturating_sub(stored))
                            .map_err(fail)?;
                    }
                    let size = entry.size();
                    let content = self.contents(&mut self.guarded(entry), size, &name)?;
                    Kind::File { size, content }
                }
            }
            EntryType::Symlink => Kind::Symlink(symlink_target(entry).map_err(fail)?),
            EntryType::Link => Kind::Hardlink(hardlink_target(entry).map_err(fail)?),
            EntryType::Char | EntryType::Block => device(entry.header(), etype).map_err(fail)?,
            EntryType::Fifo => Kind::Fifo,
            // Global PAX headers and the like carry nothing a tree needs;
            // the tar reader already applied the per-entry ones.
            EntryType::XGlobalHeader | EntryType::XHeader | EntryType::GNULongName | EntryType::GNULongLink => {
                return Ok(None)
            }
            other => {
                return Err(fail(format!(
                    "unsupported tar entry type {:?}",
                    other.as_byte() as char
                )))
            }
        };
        if path.is_empty() && kind != Kind::Dir {
            return Err(fail("the root is not a directory".into()));
        }
        Ok(Some(LayerEntry { path, kind, meta }))
    }

    /// Takes the `holes` a sparse file of `size` bytes declares from the
    /// budget.
    fn spend_holes(&self, size: u64, holes: u64) -> Result<(), String> {
        if holes == 0 {
            return Ok(());
        }
        self.sparse_budget
            .fetch_update(Relaxed, Relaxed, |left| left.checked_sub(holes))
            .map(drop)
            .map_err(|left| {
                let limit = crate::bounded::size(MAX_SPARSE_HOLES);
                let past = match left {
                    MAX_SPARSE_HOLES => format!("the {limit} of holes a pull expands"),
                    left => format!("the {left} bytes left of the {limit} of holes a pull expands"),
                };
                format!("a sparse file of {size} bytes, {holes} of them holes: more than {past}")
            })
    }

    /// `data` read until the pull is stopped.
    fn guarded<R: Read>(&self, data: R) -> Guarded<'a, R> {
        Guarded {
            inner: data,
            stop: self.opts.stop,
            headers: None,
        }
    }

    /// Whether a file of `size` bytes is read into memory (kept inline or
    /// handed to the offload) rather than streamed into the store.
    fn in_memory(&self, size: u64) -> bool {
        size <= RECOMMENDED_INLINE_MAX || (size <= OFFLOAD_MAX && self.opts.offload.is_some())
    }

    /// The `size` bytes of the file `name` read from `data`: kept inline,
    /// handed to the offload, or (larger ones) streamed into the store.
    fn contents(&mut self, data: &mut dyn Read, size: u64, name: &str) -> Result<Content, OciError> {
        let blob = self.blob;
        let fail = |reason: String| OciError::layer(blob, Some(name), reason);
        if self.in_memory(size) {
            let mut buf = Vec::with_capacity(size as usize);
            data.take(size + 1)
                .read_to_end(&mut buf)
                .map_err(|e| fail(format!("cannot read contents: {e}")))?;
            if buf.len() as u64 != size {
                return Err(fail("contents end early".into()));
            }
            return Ok(match self.opts.offload {
                Some(offload) if size > RECOMMENDED_INLINE_MAX => {
                    let id = self.jobs;
                    self.jobs += 1;
                    offload(Job { id, data: buf });
                    Content::Pending(id)
                }
                _ => Content::Inline(buf),
            });
        }
        let d = self
            .ingest
            .import_reader(Path::new(name), size, data)
            .map_err(|e| store_error(e, fail))?;
        Ok(Content::Object(d))
    }
}

/// A store's failure to import an entry's contents: the entry's own
/// failures (it ends early, say) named by `fail`.
fn store_error(e: tilefs_store::StoreError, fail: impl Fn(String) -> OciError) -> OciError {
    match e {
        tilefs_store::StoreError::Interrupted => OciError::Interrupted,
        tilefs_store::StoreError::SourceIo { what, err, .. } => fail(format!("{what}: {err}")),
        tilefs_store::StoreError::Source { msg, .. } => fail(msg.to_string()),
        e => OciError::Store(e),
    }
}

/// PAX records, (key, value) in order.
type PaxRecords = Vec<(Vec<u8>, Vec<u8>)>;

/// An entry's PAX records.
fn pax_records<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<PaxRecords, String> {
    let mut pax = Vec::new();
    if let Some(exts) = entry.pax_extensions().map_err(|e| format!("bad PAX header: {e}"))? {
        for ext in exts {
            let ext = ext.map_err(|e| format!("bad PAX record: {e}"))?;
            pax.push((ext.key_bytes().to_vec(), ext.value_bytes().to_vec()));
        }
    }
    Ok(pax)
}

/// An entry's metadata: its header's, with the xattrs and the mtime of
/// its PAX records.
fn meta_of(header: &tar::Header, pax: &[(Vec<u8>, Vec<u8>)]) -> Result<Meta, String> {
    let mut meta = Meta {
        perm: header.mode().map_err(|e| format!("bad mode: {e}"))? & 0o7777,
        uid: id_field(header.uid(), "uid")?,
        gid: id_field(header.gid(), "gid")?,
        mtime: Timespec {
            sec: header.mtime().map_err(|e| format!("bad mtime: {e}"))? as i64,
            nsec: 0,
        },
        xattrs: Vec::new(),
    };
    for (key, value) in pax {
        if let Some(xattr) = key.strip_prefix(b"SCHILY.xattr.") {
            meta.xattrs.push((xattr.to_vec(), value.clone()));
        } else if key == b"mtime" {
            meta.mtime = pax_time(value).ok_or("bad PAX mtime")?;
        }
    }
    Ok(meta)
}

/// What an entry's name makes it, whatever its type.
pub(crate) enum Marker {
    /// Neither a whiteout nor an opaque marker.
    No,
    /// Bookkeeping of old tools (other `.wh..wh.` names, aufs hardlink
    /// directories): runtimes skip them.
    Skip,
    /// A whiteout or an opaque marker, with the path it removes or the
    /// directory it hides.
    Is(Kind, Vec<Vec<u8>>),
}

/// Tells whiteouts and opaque markers by their last name, and judges them
/// by the path they remove or hide.
pub(crate) fn marker(path: &[Vec<u8>]) -> Result<Marker, String> {
    let Some(last) = path.last() else {
        return Ok(Marker::No);
    };
    let (kind, path, what) = if last.as_slice() == OPAQUE_MARKER {
        (Kind::Opaque, path[..path.len() - 1].to_vec(), "the directory it hides")
    } else if let Some(target) = last.strip_prefix(WHITEOUT_PREFIX) {
        if target.starts_with(WHITEOUT_PREFIX) {
            return Ok(Marker::Skip);
        }
        if target.is_empty() || target == b"." || target == b".." {
            return Err("whiteout of an invalid name".into());
        }
        let mut removed = path.to_vec();
        *removed.last_mut().unwrap() = target.to_vec();
        (Kind::Whiteout, removed, "the path it removes")
    } else {
        return Ok(Marker::No);
    };
    check_path(&path, kind == Kind::Opaque, what)?;
    Ok(Marker::Is(kind, path))
}

/// A symlink's target, within what symlink(2) takes.
fn symlink_target<R: Read>(entry: &tar::Entry<'_, R>) -> Result<Vec<u8>, String> {
    let target = entry.link_name_bytes().ok_or("symlink without a target")?.into_owned();
    if target.is_empty() {
        return Err("symlink with an empty target".into());
    }
    if target.contains(&0) {
        return Err("symlink target holds a NUL byte".into());
    }
    if target.len() > MAX_PAYLOAD_LEN {
        return Err(format!(
            "symlink target is {} bytes, longer than {MAX_PAYLOAD_LEN} (PATH_MAX, 4096, counts the NUL)",
            target.len()
        ));
    }
    Ok(target)
}

/// A hardlink's target: a path below the root, as an entry's.
fn hardlink_target<R: Read>(entry: &tar::Entry<'_, R>) -> Result<Vec<Vec<u8>>, String> {
    let target = entry.link_name_bytes().ok_or("hardlink without a target")?.into_owned();
    let target = split_path(&target).map_err(|r| format!("hardlink target: {r}"))?;
    if target.is_empty() {
        return Err("hardlink to the root".into());
    }
    check_path(&target, false, "its target")?;
    Ok(target)
}

/// A character or block device (`etype`), with its number.
fn device(header: &tar::Header, etype: EntryType) -> Result<Kind, String> {
    let major = header
        .device_major()
        .map_err(|e| format!("bad device major: {e}"))?
        .unwrap_or(0);
    let minor = header
        .device_minor()
        .map_err(|e| format!("bad device minor: {e}"))?
        .unwrap_or(0);
    let rdev = rustix::fs::makedev(major, minor) as u32;
    let mode_type = if etype == EntryType::Char { S_IFCHR } else { S_IFBLK };
    Ok(Kind::Device { mode_type, rdev })
}

/// A PAX sparse file (GNU tar's `--sparse --format=posix`): formats 0.1
/// (map in a record) and 1.0 (map at the start of the data). The tar
/// reader handles the old GNU sparse headers itself.
#[derive(Debug, Default)]
struct SparseInfo {
    major: Option<Vec<u8>>,
    map: Option<Vec<u8>>,
    name: Option<Vec<u8>>,
    real_size: Option<u64>,
    old_style: bool,
}

impl SparseInfo {
    fn from_pax(pax: &[(Vec<u8>, Vec<u8>)]) -> SparseInfo {
        let mut s = SparseInfo::default();
        for (k, v) in pax {
            let Some(k) = k.strip_prefix(b"GNU.sparse.") else {
                continue;
            };
            match k {
                b"major" => s.major = Some(v.clone()),
                b"map" => s.map = Some(v.clone()),
                b"name" => s.name = Some(v.clone()),
                b"realsize" | b"size" => s.real_size = std::str::from_utf8(v).ok().and_then(|v| v.parse().ok()),
                b"offset" | b"numbytes" => s.old_style = true,
                _ => {}
            }
        }
        s
    }

    fn is_sparse(&self) -> bool {
        self.major.is_some() || self.map.is_some() || self.old_style
    }

    /// The file's contents, holes as zeros.
    fn reader<'a>(&self, data: &'a mut dyn Read) -> Result<SparseReader<'a>, String> {
        if self.old_style {
            return Err("PAX sparse format 0.0 is not supported (write it with GNU tar's default format)".into());
        }
        let real = self.real_size.ok_or("sparse file without its real size")?;
        let mut data = data;
        let numbers: Vec<u64> = match (&self.major, &self.map) {
            (Some(m), _) if m.as_slice() == b"1" => {
                // Decimal lines: a count, then offset and size pairs, the
                // whole padded to 512 bytes.
                let mut read = 0u64;
                let mut line = |data: &mut &'a mut dyn Read| -> Result<u64, String> {
                    let mut v: u64 = 0;
                    let mut digits = 0;
                    loop {
                        let mut b = [0u8];
                        data.read_exact(&mut b).map_err(|e| format!("sparse map: {e}"))?;
                        read += 1;
                        match b[0] {
                            b'\n' if digits > 0 => return Ok(v),
                            c @ b'0'..=b'9' if digits < 20 => {
                                v = v
                                    .checked_mul(10)
                                    .and_then(|v| v.checked_add(u64::from(c - b'0')))
                                    .ok_or("sparse map: number too large")?;
                                digits += 1;
                            }
                            _ => return Err("sparse map: not a decimal number".into()),
                        }
                    }
                };
                let count = line(&mut data)?;
                if count > 1 << 20 {
                    return Err("sparse map: too many pieces".into());
                }
                let mut v = Vec::with_capacity(2 * count as usize);
                for _ in 0..2 * count {
                    v.push(line(&mut data)?);
                }
                let pad = (512 - read % 512) % 512;
                io::copy(&mut (&mut *data).take(pad), &mut io::sink()).map_err(|e| format!("sparse map: {e}"))?;
                v
            }
            (_, Some(map)) => std::str::from_utf8(map)
                .ok()
                .and_then(|m| {
                    m.split(',')
                        .map(|n| n.trim().parse().ok())
                        .collect::<Option<Vec<u64>>>()
                })
                .filter(|v| v.len() % 2 == 0)
                .ok_or("sparse map: not offset,size pairs")?,
            _ => return Err("unsupported PAX sparse format".into()),
        };
        let mut pieces = Vec::new();
        let mut end = 0u64;
        for pair in numbers.chunks(2) {
            let (off, len) = (pair[0], pair[1]);
            let piece_end = off.checked_add(len).ok_or("sparse map: piece past the end")?;
            if off < end || piece_end > real {
                return Err("sparse map: pieces overlap, are out of order or pass the file's end".into());
            }
            end = piece_end;
            pieces.push((off, len));
        }
        Ok(SparseReader {
            data,
            pieces,
            next: 0,
            pos: 0,
            real,
        })
    }
}

impl SparseReader<'_> {
    /// Bytes of the file its pieces do not hold.
    fn holes(&self) -> u64 {
        self.real - self.pieces.iter().map(|p| p.1).sum::<u64>()
    }
}

/// Expands a sparse file's pieces into its contents.
struct SparseReader<'a> {
    data: &'a mut dyn Read,
    pieces: Vec<(u64, u64)>,
    next: usize,
    pos: u64,
    real: u64,
}

impl Read for SparseReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.real || buf.is_empty() {
            return Ok(0);
        }
        // Past the current piece: on to the next one.
        while let Some(&(off, len)) = self.pieces.get(self.next) {
            if self.pos < off + len || len == 0 && self.pos < off {
                break;
            }
            self.next += 1;
        }
        let (hole_end, piece) = match self.pieces.get(self.next) {
            Some(&(off, len)) if self.pos >= off => (self.pos, Some(off + len)),
            Some(&(off, _)) => (off, None),
            None => (self.real, None),
        };
        let n = if let Some(piece_end) = piece {
            let want = (piece_end - self.pos).min(buf.len() as u64) as usize;
            let n = self.data.read(&mut buf[..want])?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "sparse data ends early"));
            }
            n
        } else {
            let n = (hole_end - self.pos).min(buf.len() as u64) as usize;
            buf[..n].fill(0);
            n
        };
        self.pos += n as u64;
        Ok(n)
    }
}

/// Longest name messages show whole (twice PATH_MAX).
const SHOWN_NAME: usize = 8192;

/// A member name for messages: bytes that are not UTF-8 escaped, and a
/// name longer than [`SHOWN_NAME`] cut short (saying how long it is).
fn display_name(raw: &[u8]) -> String {
    match raw.len() > SHOWN_NAME {
        false => raw.escape_ascii().to_string(),
        true => format!("{}… ({} bytes)", raw[..SHOWN_NAME].escape_ascii(), raw.len()),
    }
}

/// Splits a tar member name into components below the root: `./` and
/// repeated or trailing slashes are dropped; `..` and absolute names are
/// refused (a layer never names anything outside its root). Lengths are
/// for [`check_path`], once it is known what the path names.
pub fn split_path(raw: &[u8]) -> Result<Vec<Vec<u8>>, &'static str> {
    if raw.first() == Some(&b'/') {
        return Err("absolute name (escapes the root)");
    }
    if raw.contains(&0) {
        return Err("name holds a NUL byte");
    }
    let mut out = Vec::new();
    for comp in raw.split(|&c| c == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => return Err("name holds `..` (escapes the root)"),
            c => out.push(c.to_vec()),
        }
    }
    Ok(out)
}

/// Checks a path against the limits of the module's rules: each name at
/// most NAME_MAX bytes, and no deeper than [`MAX_DEPTH`] directories
/// (`dir`: the path names a directory). `what` says whose path it is.
pub fn check_path(path: &[Vec<u8>], dir: bool, what: &str) -> Result<(), String> {
    if let Some((i, c)) = path.iter().enumerate().find(|(_, c)| c.len() > MAX_NAME_LEN) {
        return Err(format!(
            "name {} of {what} is {} bytes, longer than NAME_MAX ({MAX_NAME_LEN})",
            i + 1,
            c.len()
        ));
    }
    let dirs = if dir { path.len() } else { path.len().saturating_sub(1) };
    if dirs > MAX_DEPTH {
        return Err(format!(
            "{what} is {dirs} directories deep, more than the {MAX_DEPTH} tilefs reads from an image"
        ));
    }
    Ok(())
}

fn id_field(v: io::Result<u64>, what: &str) -> Result<u32, String> {
    let v = v.map_err(|e| format!("bad {what}: {e}"))?;
    u32::try_from(v).map_err(|_| format!("{what} {v} does not fit in 32 bits"))
}

/// A PAX time (`[-]SECONDS[.FRACTION]`) as seconds and nanoseconds
/// (digits past the ninth are dropped; a negative time is rounded down to
/// a whole second and counted up from there, as `struct timespec` holds it).
fn pax_time(v: &[u8]) -> Option<Timespec> {
    let s = std::str::from_utf8(v).ok()?;
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let sec: i64 = int.parse().ok()?;
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mut nsec: u32 = 0;
    for (i, b) in frac.bytes().take(9).enumerate() {
        nsec += u32::from(b - b'0') * 10u32.pow(8 - i as u32);
    }
    if int.starts_with('-') && nsec > 0 {
        return Some(Timespec {
            sec: sec.checked_sub(1)?,
            nsec: 1_000_000_000 - nsec,
        });
    }
    Some(Timespec { sec, nsec })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_below_the_root() {
        assert_eq!(
            split_path(b"./usr//bin/").unwrap(),
            vec![b"usr".to_vec(), b"bin".to_vec()]
        );
        assert!(split_path(b"./").unwrap().is_empty());
        assert!(split_path(b"/etc/passwd").is_err());
        assert!(split_path(b"usr/../../etc").is_err());
        assert!(split_path(b"..").is_err());
    }

    /// The entries of a layer of empty files named by PAX `path` records.
    fn read_names(names: &[Vec<u8>]) -> Result<Vec<LayerEntry>, OciError> {
        let mut b = tar::Builder::new(Vec::new());
        for n in names {
            b.append_pax_extensions([("path", n.as_slice())]).unwrap();
            let mut h = tar::Header::new_ustar();
            h.set_path("stand-in").unwrap();
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_size(0);
            h.set_cksum();
            b.append(&h, io::empty()).unwrap();
        }
        let tar = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = tilefs_store::Store::create(&dir.path().join("store")).unwrap();
        let ingest = Ingest::new(&store, tilefs_store::ingest::Method::Copy).unwrap();
        read_entries(&mut &tar[..], "l", &ingest, ReadOptions::default())
    }

    #[test]
    fn whiteouts_are_judged_by_the_name_they_remove() {
        let n = |len| vec![b'n'; len];
        let cat = |parts: &[&[u8]]| parts.concat();
        // `.wh.` and 255 bytes: a name of 259 bytes, a whiteout of 255.
        let e = read_names(&[cat(&[b"d/.wh.", &n(255)])]).unwrap();
        assert_eq!(
            (&e[0].kind, &e[0].path),
            (&Kind::Whiteout, &vec![b"d".to_vec(), n(255)])
        );
        let e = read_names(&[cat(&[&n(255), b"/.wh..wh..opq"])]).unwrap();
        assert_eq!((&e[0].kind, &e[0].path), (&Kind::Opaque, &vec![n(255)]));
        // No name below can be 256 bytes long.
        let err = read_names(&[cat(&[b"d/.wh.", &n(256)])]).unwrap_err().to_string();
        assert!(
            err.contains("name 2 of the path it removes is 256 bytes, longer than NAME_MAX (255)"),
            "{err}"
        );
        let err = read_names(&[cat(&[&n(256), b"/.wh..wh..opq"])])
            .unwrap_err()
            .to_string();
        assert!(err.contains("name 1 of the directory it hides is 256 bytes"), "{err}");
        let err = read_names(&[cat(&[b"d/", &n(256)])]).unwrap_err().to_string();
        assert!(
            err.starts_with("layer l: d/nnnn") && err.contains("name 2 of its path is 256 bytes"),
            "{err}"
        );
    }

    #[test]
    fn paths_past_path_max_are_taken_down_to_the_depth_an_image_holds() {
        let path = |dirs: usize| format!("{}/f", vec!["d"; dirs].join("/")).into_bytes();
        let long = vec![vec![b'n'; 255]; 20].join(&b'/');
        let e = read_names(&[long.clone(), path(MAX_DEPTH)]).unwrap();
        assert_eq!((e[0].path.len(), e[1].path.len()), (20, MAX_DEPTH + 1));
        let err = read_names(&[path(MAX_DEPTH + 1)]).unwrap_err().to_string();
        assert!(
            err.contains("its path is 2049 directories deep, more than the 2048"),
            "{err}"
        );
    }

    #[test]
    fn only_sparse_files_spend_holes() {
        // A regular file whose size is a PAX record (the header's says 0,
        // as writers put sizes past 8 GiB): no holes, whatever the header.
        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([("size", &b"5"[..])]).unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_path("f").unwrap();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(0);
        h.set_cksum();
        b.append(&h, &b"hello"[..]).unwrap();
        let tar = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = tilefs_store::Store::create(&dir.path().join("store")).unwrap();
        let ingest = Ingest::new(&store, tilefs_store::ingest::Method::Copy).unwrap();
        let budget = AtomicU64::new(0);
        let opts = ReadOptions {
            sparse_budget: Some(&budget),
            ..ReadOptions::default()
        };
        let e = read_entries(&mut &tar[..], "l", &ingest, opts).unwrap();
        assert_eq!(
            e[0].kind,
            Kind::File {
                size: 5,
                content: Content::Inline(b"hello".to_vec())
            }
        );
    }

    #[test]
    fn pax_times_keep_nanoseconds() {
        let t = |sec, nsec| Some(Timespec { sec, nsec });
        assert_eq!(pax_time(b"1650000000.75"), t(1650000000, 750_000_000));
        assert_eq!(pax_time(b"12"), t(12, 0));
        assert_eq!(pax_time(b"1.1234567891"), t(1, 123_456_789));
        assert_eq!(pax_time(b"-1.5"), t(-2, 500_000_000));
        assert_eq!(pax_time(b"x"), None);
    }

    #[test]
    fn compression_is_sniffed() {
        assert_eq!(Compression::sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(Compression::sniff(&[0x28, 0xb5, 0x2f, 0xfd]), Compression::Zstd);
        assert_eq!(Compression::sniff(b"usr/"), Compression::None);
    }
}
