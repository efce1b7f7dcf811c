//! OCI image layouts: a directory (`oci:DIR`) or a tar archive of one
//! (`oci-archive:FILE`, read in place: its members are found by offset,
//! never extracted).

use super::{choose, read_checked, resolve_manifest, Resolved, Transport};
use crate::digest::Digest;
use crate::manifest::{BlobRef, Platform, MAX_MANIFEST};
use crate::OciError;
use oci_spec::image::ImageIndex;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The annotation naming an image in a layout's index.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Files of a layout, wherever they are.
pub(crate) enum Files {
    Dir(PathBuf),
    Archive(ArchiveFiles),
}

impl Files {
    /// What the files are, for messages.
    pub(crate) fn describe(&self, rel: &str) -> String {
        match self {
            Files::Dir(d) => d.join(rel).display().to_string(),
            Files::Archive(a) => format!("{} (member {rel})", a.path.display()),
        }
    }

    /// Opens `len` bytes of a file of the layout from `offset` (a shorter
    /// file reads short: the caller's size check reports it).
    pub(crate) fn open_range(&self, rel: &str, offset: u64, len: u64) -> Result<Box<dyn Read + Send + '_>, OciError> {
        match self {
            Files::Dir(d) => {
                use std::io::{Seek, SeekFrom};
                let path = d.join(rel);
                let mut f = open_regular(&path)?;
                f.seek(SeekFrom::Start(offset))
                    .map_err(|e| OciError::io(&path, "cannot seek", e))?;
                Ok(Box::new(f.take(len)))
            }
            Files::Archive(a) => {
                let &(start, size) = a.members.get(rel).ok_or_else(|| {
                    OciError::io(
                        &a.path,
                        "not in the archive",
                        io::Error::other(format!("no member {rel}")),
                    )
                })?;
                let from = start + offset.min(size);
                Ok(Box::new(MemberReader {
                    file: &a.file,
                    pos: from,
                    end: from + len.min(size - offset.min(size)),
                }))
            }
        }
    }

    /// Opens a file of the layout and says how long it is.
    pub(crate) fn open(&self, rel: &str) -> Result<(Box<dyn Read + Send + '_>, u64), OciError> {
        match self {
            Files::Dir(d) => {
                let path = d.join(rel);
                let f = open_regular(&path)?;
                let len = f.metadata().map_err(|e| OciError::io(&path, "cannot stat", e))?.len();
                Ok((Box::new(f), len))
            }
            Files::Archive(a) => {
                let &(offset, len) = a.members.get(rel).ok_or_else(|| {
                    OciError::io(
                        &a.path,
                        "not in the archive",
                        io::Error::other(format!("no member {rel}")),
                    )
                })?;
                Ok((
                    Box::new(MemberReader {
                        file: &a.file,
                        pos: offset,
                        end: offset + len,
                    }),
                    len,
                ))
            }
        }
    }

    /// Reads a whole small file (at most `limit` bytes).
    pub(crate) fn read_small(&self, rel: &str, limit: u64) -> Result<Vec<u8>, OciError> {
        let (mut r, len) = self.open(rel)?;
        if len > limit {
            return Err(OciError::manifest(
                self.describe(rel),
                format!("larger than {limit} bytes"),
            ));
        }
        let mut v = Vec::with_capacity(len as usize);
        r.read_to_end(&mut v)
            .map_err(|e| OciError::manifest(self.describe(rel), format!("cannot read: {e}")))?;
        Ok(v)
    }
}

/// Opens a file of a layout or archive (symlinks followed: it is the
/// user's), refusing anything but a regular file without blocking on it.
pub(crate) fn open_regular(path: &Path) -> Result<File, OciError> {
    tilefs_store::open_regular(rustix::fs::CWD, path, true).map_err(|e| OciError::io(path, "cannot open", e))
}

/// A tar archive's regular files, by name: (offset of the data, length).
pub(crate) struct ArchiveFiles {
    pub(crate) path: PathBuf,
    file: File,
    pub(crate) members: HashMap<String, (u64, u64)>,
}

impl ArchiveFiles {
    pub(crate) fn open(path: &Path) -> Result<ArchiveFiles, OciError> {
        let file = open_regular(path)?;
        let mut head = [0u8; 4];
        let n = file
            .read_at(&mut head, 0)
            .map_err(|e| OciError::io(path, "cannot read", e))?;
        if crate::layer::Compression::sniff(&head[..n]) != crate::layer::Compression::None {
            return Err(OciError::io(
                path,
                "cannot read",
                io::Error::other("a compressed archive (decompress it first: the archive is read in place)"),
            ));
        }
        let mut members = HashMap::new();
        let mut archive = tar::Archive::new(io::BufReader::with_capacity(1 << 16, &file));
        let entries = archive
            .entries_with_seek()
            .map_err(|e| OciError::io(path, "not a tar archive", e))?;
        for entry in entries {
            let entry = entry.map_err(|e| OciError::io(path, "not a valid tar archive", e))?;
            let kind = entry.header().entry_type();
            if !(kind.is_file() || kind == tar::EntryType::Continuous) {
                continue;
            }
            let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            let name = name.trim_start_matches("./").to_string();
            members.insert(name, (entry.raw_file_position(), entry.size()));
        }
        Ok(ArchiveFiles {
            path: path.to_path_buf(),
            file,
            members,
        })
    }
}

/// Reads one member of an archive with positioned reads (several layers
/// of one archive are read at once).
struct MemberReader<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for MemberReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = (self.end - self.pos).min(buf.len() as u64) as usize;
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "archive member ends early",
            ));
        }
        self.pos += n as u64;
        Ok(n)
    }
}

/// An OCI image layout and the image chosen in it.
pub struct Layout {
    files: Files,
    tag: Option<String>,
}

impl Layout {
    pub fn open_dir(dir: &Path, tag: Option<String>) -> Result<Layout, OciError> {
        let md = std::fs::metadata(dir).map_err(|e| OciError::io(dir, "cannot open the OCI layout", e))?;
        if !md.is_dir() {
            return Err(OciError::io(
                dir,
                "not an OCI layout",
                io::Error::other("not a directory"),
            ));
        }
        Ok(Layout {
            files: Files::Dir(dir.to_path_buf()),
            tag,
        })
    }

    pub fn open_archive(file: &Path, tag: Option<String>) -> Result<Layout, OciError> {
        Ok(Layout {
            files: Files::Archive(ArchiveFiles::open(file)?),
            tag,
        })
    }

    fn fetch(&self, d: &Digest, size: u64) -> Result<Vec<u8>, OciError> {
        let rel = d.layout_path();
        let (r, _) = self.files.open(&rel)?;
        read_checked(r, d, size.min(MAX_MANIFEST), "manifest")
    }
}

impl Transport for Layout {
    fn resolve(&self, platform: &Platform) -> Result<Resolved, OciError> {
        let what = self.files.describe("index.json");
        let raw = self.files.read_small("index.json", MAX_MANIFEST)?;
        let index = ImageIndex::from_reader(raw.as_slice())
            .map_err(|e| OciError::manifest(&what, format!("not an OCI image index: {e}")))?;
        let name_of = |d: &oci_spec::image::Descriptor| {
            d.annotations()
                .as_ref()
                .and_then(|a| a.get(REF_NAME))
                .cloned()
                .into_iter()
                .collect()
        };
        let chosen = choose(
            index.manifests(),
            self.tag.as_deref(),
            name_of,
            &what,
            "the layout",
            "DIR:NAME",
        )?;
        let d = crate::manifest::descriptor_digest(chosen, &what)?;
        let top = self.fetch(&d, chosen.size())?;
        resolve_manifest(top, Some(d.clone()), &format!("manifest {d}"), platform, &|d, s| {
            self.fetch(d, s)
        })
    }

    fn open_blob(&self, blob: &BlobRef) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let rel = blob.member.clone().unwrap_or_else(|| blob.digest.layout_path());
        Ok(self.files.open(&rel)?.0)
    }

    fn open_range(&self, blob: &BlobRef, offset: u64, len: u64) -> Result<Box<dyn Read + Send + '_>, OciError> {
        self.files.open_range(&blob.digest.layout_path(), offset, len)
    }

    fn origin(&self) -> String {
        self.files.describe("")
    }
}
