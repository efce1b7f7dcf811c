//! The JSON of both tables of contents, read strictly (a field this crate
//! does not know is refused: what it might mean is not guessed), and
//! turned into the shared model with every rule of [`super`] checked.

use std::collections::HashMap;
use std::fmt;

use base64::Engine as _;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::{check_target, clean_path, Chunk, Entry, File, Format, Kind, Toc, MAX_ENTRIES};
use crate::digest::{truncate, Digest};
use crate::error::{Error, Result};
use crate::time::parse_rfc3339;

/// Linux's limits on extended attributes (XATTR_NAME_MAX, XATTR_SIZE_MAX,
/// XATTR_LIST_MAX).
const MAX_XATTR_NAME: usize = 255;
const MAX_XATTR_VALUE: usize = 65536;
const MAX_XATTR_NAMES: usize = 65536;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JsonToc {
    version: i64,
    entries: Option<Entries>,
    tar_split_digest: Option<String>,
}

/// Both formats' entry fields: eStargz's `TOCEntry` and zstd:chunked's
/// `FileMetadata`. Which belong to which is checked after parsing.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JsonEntry {
    name: String,
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    size: i64,
    modtime: Option<String>,
    accesstime: Option<String>,
    changetime: Option<String>,
    link_name: Option<String>,
    #[serde(default)]
    mode: i64,
    #[serde(default)]
    uid: i64,
    #[serde(default)]
    gid: i64,
    user_name: Option<String>,
    group_name: Option<String>,
    #[serde(default)]
    offset: i64,
    #[serde(default)]
    inner_offset: i64,
    #[serde(default)]
    end_offset: i64,
    #[serde(default)]
    dev_major: i64,
    #[serde(default)]
    dev_minor: i64,
    xattrs: Option<Xattrs>,
    digest: Option<String>,
    #[serde(default)]
    chunk_offset: i64,
    #[serde(default)]
    chunk_size: i64,
    chunk_digest: Option<String>,
    chunk_type: Option<String>,
}

/// The entry list, refused past [`MAX_ENTRIES`] while it is read.
struct Entries(Vec<JsonEntry>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of entries")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = seq.next_element()? {
                    if v.len() == MAX_ENTRIES {
                        return Err(de::Error::custom(format!("more than {MAX_ENTRIES} entries")));
                    }
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_seq(V)
    }
}

/// Extended attributes: names to base64 values, each name once.
struct Xattrs(Vec<(String, String)>);

impl<'de> Deserialize<'de> for Xattrs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Xattrs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of extended attributes")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Xattrs, A::Error> {
                let mut v: Vec<(String, String)> = Vec::new();
                let mut names = 0;
                while let Some((k, val)) = map.next_entry::<String, String>()? {
                    names += k.len() + 1;
                    if names > MAX_XATTR_NAMES {
                        return Err(de::Error::custom("extended attribute names over XATTR_LIST_MAX"));
                    }
                    v.push((k, val));
                }
                v.sort_by(|a, b| a.0.cmp(&b.0));
                if let Some(w) = v.windows(2).find(|w| w[0].0 == w[1].0) {
                    return Err(de::Error::custom(format!(
                        "extended attribute {:?} twice",
                        truncate(&w[0].0)
                    )));
                }
                Ok(Xattrs(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// Where a format's chunks may lie: before the table of contents.
pub(crate) struct Layout {
    pub format: Format,
    pub payload_end: u64,
}

/// A chunk as listed, before its compressed end is known.
struct RawChunk {
    offset: u64,
    size: u64,
    at: u64,
    skip: u64,
    end: u64,
    digest: Option<Digest>,
    zeros: bool,
}

/// Parses a table of contents (JSON already checked against its digest).
pub(crate) fn parse(json: &[u8], layout: Layout) -> Result<Toc> {
    let name = match layout.format {
        Format::Estargz => "eStargz",
        Format::ZstdChunked => "zstd:chunked",
    };
    let doc: JsonToc =
        serde_json::from_slice(json).map_err(|e| Error::toc(format!("{name} table of contents: {e}")))?;
    if doc.version != 1 {
        return Err(Error::toc(format!(
            "{name} table of contents version {}, not 1",
            doc.version
        )));
    }
    let tar_split_digest = match (&doc.tar_split_digest, layout.format) {
        (None, _) => None,
        (Some(d), Format::ZstdChunked) => Some(Digest::parse(d, "tarSplitDigest")?),
        (Some(_), Format::Estargz) => return Err(Error::toc("eStargz table of contents with a tarSplitDigest")),
    };
    let mut b = Builder {
        format: layout.format,
        payload_end: layout.payload_end,
        entries: Vec::new(),
        paths: HashMap::new(),
        open: None,
    };
    for (i, e) in doc.entries.map(|e| e.0).unwrap_or_default().iter().enumerate() {
        b.add(e).map_err(|err| match err {
            Error::Toc(msg) => Error::toc(format!("{name} entry {i} ({:?}): {msg}", truncate(&e.name))),
            other => other,
        })?;
    }
    b.close_file()?;
    if layout.format == Format::Estargz {
        b.estargz_ends()?;
    }
    Ok(Toc {
        format: layout.format,
        entries: b.entries.into_iter().map(|(e, _)| e).collect(),
        tar_split_digest,
    })
}

struct Builder {
    format: Format,
    payload_end: u64,
    /// Entries so far; a regular file's listed chunks beside it.
    entries: Vec<(Entry, Vec<RawChunk>)>,
    paths: HashMap<String, usize>,
    /// The regular file whose chunk entries may follow.
    open: Option<usize>,
}

fn unsigned(v: i64, field: &str) -> Result<u64> {
    u64::try_from(v).map_err(|_| Error::toc(format!("negative {field} ({v})")))
}

fn u32_field(v: i64, field: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::toc(format!("{field} {v} out of range")))
}

fn digest_field(v: &Option<String>, field: &str) -> Result<Option<Digest>> {
    v.as_deref().map(|d| Digest::parse(d, field)).transpose()
}

impl Builder {
    fn add(&mut self, e: &JsonEntry) -> Result<()> {
        self.check_fields_of_format(e)?;
        if e.kind == "chunk" {
            let i = self
                .open
                .ok_or_else(|| Error::toc("a chunk that follows no regular file"))?;
            if clean_path(&e.name)? != self.entries[i].0.path {
                return Err(Error::toc("a chunk of another file than the one before it"));
            }
            let c = self.raw_chunk(e)?;
            self.entries[i].1.push(c);
            return Ok(());
        }
        self.close_file()?;
        let path = clean_path(&e.name)?;
        if self.paths.contains_key(&path) {
            return Err(Error::toc("listed twice"));
        }
        if path.is_empty() && e.kind != "dir" {
            return Err(Error::toc(format!("the root as a {}", e.kind)));
        }
        let is_reg = e.kind == "reg";
        let is_link = matches!(e.kind.as_str(), "symlink" | "hardlink");
        let is_dev = matches!(e.kind.as_str(), "char" | "block");
        if !is_reg
            && (e.size != 0
                || e.offset != 0
                || e.end_offset != 0
                || e.inner_offset != 0
                || e.chunk_offset != 0
                || e.chunk_size != 0
                || e.digest.is_some()
                || e.chunk_digest.is_some()
                || e.chunk_type.is_some())
        {
            return Err(Error::toc(format!("a {} with a size, content or chunks", e.kind)));
        }
        if !is_link && e.link_name.as_deref().is_some_and(|l| !l.is_empty()) {
            return Err(Error::toc(format!("a {} with a link name", e.kind)));
        }
        if !is_dev && (e.dev_major != 0 || e.dev_minor != 0) {
            return Err(Error::toc(format!("a {} with device numbers", e.kind)));
        }
        let link = || e.link_name.as_deref().unwrap_or("");
        let dev =
            || -> Result<(u32, u32)> { Ok((u32_field(e.dev_major, "devMajor")?, u32_field(e.dev_minor, "devMinor")?)) };
        let mut chunks = Vec::new();
        let kind = match e.kind.as_str() {
            "dir" => Kind::Dir,
            "reg" => {
                let size = unsigned(e.size, "size")?;
                if size > 0 {
                    chunks.push(self.raw_chunk(e)?);
                }
                Kind::File(File {
                    size,
                    digest: digest_field(&e.digest, "digest")?,
                    chunks: Vec::new(),
                })
            }
            "symlink" => Kind::Symlink {
                target: check_target(&path, link())?,
            },
            "hardlink" => {
                let target = clean_path(link())?;
                let &t = self
                    .paths
                    .get(&target)
                    .ok_or_else(|| Error::toc(format!("hardlink to {:?}, not an earlier entry", truncate(&target))))?;
                match &self.entries[t].0.kind {
                    Kind::Dir => return Err(Error::toc("hardlink to a directory")),
                    Kind::Hardlink { target } => Kind::Hardlink { target: target.clone() },
                    _ => Kind::Hardlink { target },
                }
            }
            "char" => {
                let (major, minor) = dev()?;
                Kind::CharDevice { major, minor }
            }
            "block" => {
                let (major, minor) = dev()?;
                Kind::BlockDevice { major, minor }
            }
            "fifo" => Kind::Fifo,
            other => return Err(Error::toc(format!("unknown type {:?}", truncate(other)))),
        };
        let mode = unsigned(e.mode, "mode")?;
        if mode > 0o7777777 {
            return Err(Error::toc(format!("mode {mode:#o} does not fit a tar header")));
        }
        for t in [&e.accesstime, &e.changetime].into_iter().flatten() {
            parse_rfc3339(t)?;
        }
        let entry = Entry {
            path: path.clone(),
            kind,
            mode: mode as u32 & 0o7777,
            uid: u32_field(e.uid, "uid")?,
            gid: u32_field(e.gid, "gid")?,
            mtime: e.modtime.as_deref().map(parse_rfc3339).transpose()?,
            xattrs: xattrs(e.xattrs.as_ref())?,
        };
        if is_reg && !chunks.is_empty() {
            self.open = Some(self.entries.len());
        }
        self.paths.insert(path, self.entries.len());
        self.entries.push((entry, chunks));
        Ok(())
    }

    /// Refuses the fields of the other format (both share one struct).
    fn check_fields_of_format(&self, e: &JsonEntry) -> Result<()> {
        let other = match self.format {
            Format::Estargz => [
                ("endOffset", e.end_offset != 0),
                ("chunkType", e.chunk_type.is_some()),
                ("accesstime", e.accesstime.is_some()),
                ("changetime", e.changetime.is_some()),
            ],
            Format::ZstdChunked => [
                ("innerOffset", e.inner_offset != 0),
                ("userName", e.user_name.is_some()),
                ("groupName", e.group_name.is_some()),
                ("", false),
            ],
        };
        match other.iter().find(|(_, present)| *present) {
            Some((field, _)) => Err(Error::toc(format!("field {field} is not of this format"))),
            None => Ok(()),
        }
    }

    /// The chunk a `reg` or `chunk` entry lists.
    fn raw_chunk(&self, e: &JsonEntry) -> Result<RawChunk> {
        let at = unsigned(e.offset, "offset")?;
        if at == 0 {
            return Err(Error::toc("content without an offset in the blob"));
        }
        if at >= self.payload_end {
            return Err(Error::toc(format!(
                "offset {at} is not before the table of contents (byte {})",
                self.payload_end
            )));
        }
        let zeros = match e.chunk_type.as_deref() {
            None | Some("") => false,
            Some("zeros") => true,
            Some(t) => return Err(Error::toc(format!("unknown chunkType {:?}", truncate(t)))),
        };
        Ok(RawChunk {
            offset: unsigned(e.chunk_offset, "chunkOffset")?,
            // 0: to the end of the file, settled when the file is closed.
            size: unsigned(e.chunk_size, "chunkSize")?,
            at,
            skip: unsigned(e.inner_offset, "innerOffset")?,
            end: unsigned(e.end_offset, "endOffset")?,
            digest: digest_field(&e.chunk_digest, "chunkDigest")?,
            zeros,
        })
    }

    /// Settles the chunks of the file whose chunk entries were being read.
    fn close_file(&mut self) -> Result<()> {
        let Some(i) = self.open.take() else {
            return Ok(());
        };
        let (entry, raw) = &mut self.entries[i];
        let err = |msg: String| Error::toc(format!("{:?}: {msg}", truncate(&entry.path)));
        let Kind::File(file) = &mut entry.kind else {
            unreachable!("only regular files take chunks")
        };
        let whole = raw.len() == 1;
        let main_end = raw[0].end;
        let mut next = 0u64;
        for k in 0..raw.len() {
            let c = &raw[k];
            let size = match c.size {
                0 => file.size.saturating_sub(c.offset),
                s => s,
            };
            if c.offset != next || size == 0 || size > file.size - next {
                return Err(err(format!(
                    "chunk {k} at {}+{} does not continue the chunks before it in a file of {} bytes",
                    c.offset, c.size, file.size
                )));
            }
            next += size;
            let digest = match (c.digest, whole) {
                (Some(d), _) => d,
                (None, true) => file.digest.ok_or_else(|| err("content without a digest".into()))?,
                (None, false) => return Err(err(format!("chunk {k} without a digest"))),
            };
            // zstd:chunked: a chunk runs to the next one, the last to the
            // file's endOffset. eStargz ends are settled over the whole
            // table (estargz_ends).
            let end = match self.format {
                Format::ZstdChunked => {
                    let end = raw.get(k + 1).map_or(main_end, |n| n.at);
                    if end <= c.at || end > self.payload_end {
                        return Err(err(format!(
                            "chunk {k} at blob bytes {}..{end}, not a range before byte {}",
                            c.at, self.payload_end
                        )));
                    }
                    end
                }
                Format::Estargz => 0,
            };
            file.chunks.push(Chunk {
                offset: c.offset,
                size,
                compressed: c.at..end,
                skip: c.skip,
                digest,
                zeros: c.zeros,
            });
        }
        if next != file.size {
            return Err(err(format!("chunks cover {next} of {} bytes", file.size)));
        }
        raw.clear();
        Ok(())
    }

    /// eStargz chunks are gzip members (or parts of one, past `skip`):
    /// each runs to the next member that starts after it, the last to the
    /// table of contents. Members must come in blob order.
    fn estargz_ends(&mut self) -> Result<()> {
        // (entry, chunk, member offset, skip), in table order.
        let mut list = Vec::new();
        for (i, (e, _)) in self.entries.iter().enumerate() {
            if let Kind::File(f) = &e.kind {
                list.extend(
                    f.chunks
                        .iter()
                        .enumerate()
                        .map(|(k, c)| (i, k, c.compressed.start, c.skip)),
                );
            }
        }
        if let Some(w) = list.windows(2).find(|w| (w[0].2, w[0].3) >= (w[1].2, w[1].3)) {
            return Err(Error::toc(format!(
                "eStargz {:?}: a chunk at blob byte {}+{} is not before the next one at {}+{}",
                truncate(&self.entries[w[1].0].0.path),
                w[0].2,
                w[0].3,
                w[1].2,
                w[1].3
            )));
        }
        let mut end = self.payload_end;
        for j in (0..list.len()).rev() {
            if let Some(next) = list.get(j + 1).filter(|n| n.2 > list[j].2) {
                end = next.2;
            }
            if let Kind::File(f) = &mut self.entries[list[j].0].0.kind {
                f.chunks[list[j].1].compressed.end = end;
            }
        }
        Ok(())
    }
}

fn xattrs(x: Option<&Xattrs>) -> Result<Vec<(String, Vec<u8>)>> {
    let Some(x) = x else {
        return Ok(Vec::new());
    };
    x.0.iter()
        .map(|(name, value)| {
            if name.is_empty() || name.len() > MAX_XATTR_NAME || name.contains('\0') {
                return Err(Error::toc(format!("extended attribute name {:?}", truncate(name))));
            }
            let v = base64::engine::general_purpose::STANDARD
                .decode(value)
                .map_err(|e| Error::toc(format!("extended attribute {:?}: {e}", truncate(name))))?;
            if v.len() > MAX_XATTR_VALUE {
                return Err(Error::toc(format!(
                    "extended attribute {:?} of {} bytes",
                    truncate(name),
                    v.len()
                )));
            }
            Ok((name.clone(), v))
        })
        .collect()
}
