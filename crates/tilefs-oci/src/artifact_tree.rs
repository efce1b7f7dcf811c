//! Format 3 of tilefs artifacts ([`crate::artifact`]): the image travels
//! as its tree, not as its bytes. An EROFS image changes from the first
//! inode a new file moves onward, so a new version of it shares no bytes
//! with the last one; its tree, printed as composefs-dump(5) lines in path
//! order, changes only at the lines of what changed. The lines are cut
//! into chunks where the paths say ([`plan_chunks`]: content-defined cuts,
//! as packs are cut where objects say), each chunk a blob: a new version
//! of an image has the same chunks as the last one but those around its
//! changes, which a push finds in the repository already.
//!
//! A chunk's blob is zstd of this, postcard-encoded ([`Chunk`]): the
//! format version (3), the builder's settings (the image's EROFS format
//! version: tilefs images are reproducible, the same tree and settings
//! give the same bytes), its dump lines (whole lines), and where the
//! objects of its external files lie, in line order: which pack (by
//! digest, from a table of the packs the chunk uses, so that a chunk does
//! not change when another pack of the artifact comes or goes), the
//! offset in that pack and how the object is stored there.
//!
//! A pull fetches the chunks, rebuilds the image from their lines and
//! refuses it unless its fs-verity digest is the one the artifact records
//! ([`rebuild`]); a push makes chunks only of an image that rebuilds so,
//! and otherwise pushes the image itself (format 2).

use crate::artifact::{self, Location, ObjectIndex, Stored};
use crate::digest::Digest;
use crate::manifest::BlobRef;
use crate::transport::{read_checked, Transport};
use crate::OciError;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use tilefs_image::Tree;
use tilefs_store::parse_object_rel;

/// The format version a chunk states.
pub const VERSION: u32 = 3;
/// Chunks are cut after a line whose path's hash says so once they hold
/// [`CHUNK_MIN`] bytes of lines, on average [`CHUNK_SPREAD`] bytes later,
/// at the latest at [`CHUNK_MAX`]: about 100 KB of blob each (the dump of
/// a 53k-file tree is 13 MB, 3 MB in zstd), so that a small change sends
/// two or three of them, and an image of that size has a few dozen.
pub const CHUNK_MIN: u64 = 128 << 10;
pub const CHUNK_SPREAD: u64 = 384 << 10;
pub const CHUNK_MAX: u64 = 2 << 20;
/// Largest chunk blob accepted, and the most it may decode to.
pub const MAX_CHUNK_BLOB: u64 = 64 << 20;
pub const MAX_CHUNK: u64 = 256 << 20;
/// Chunks fetched at once.
const JOBS: usize = 8;

/// One chunk of an image's tree (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    pub version: u32,
    /// The image's EROFS format version: the writer's minimum and maximum.
    pub erofs_version: u32,
    /// The packs (their digests) its objects lie in.
    pub packs: Vec<String>,
    /// composefs-dump(5) lines, each ending in a newline (the format
    /// escapes every byte that is not printable ASCII).
    pub dump: String,
    /// Per external file of its lines (not hardlinks), in line order: the
    /// pack (a number in `packs`), the offset, and the bytes stored there
    /// (0: the object as it is).
    pub objects: Vec<(u32, u64, u64)>,
}

/// Per line of a dump, the object its file is stored in, if any.
type LineObjects = Vec<Option<[u8; 32]>>;

/// The lines of `tree`'s dump and, per line, the object its file is
/// stored in (an external file's primary entry) if any. `None` where the
/// tree does not print.
fn lines_of(tree: &Tree) -> Option<(Vec<u8>, LineObjects)> {
    let mut dump = Vec::new();
    tilefs_image::dump::print(tree, &mut dump).ok()?;
    let mut objects = Vec::new();
    tree.walk(|_, entry, id| {
        let inode = tree.inode(id);
        let primary = !entry.is_some_and(|e| e.hardlink);
        objects.push(
            inode
                .payload
                .as_deref()
                .filter(|_| primary && inode.is_external())
                .and_then(parse_object_rel),
        );
    });
    Some((dump, objects))
}

/// Where a run of lines (`lines[range]`) is cut into chunks: after a line
/// whose path's hash (read as a number) falls under a threshold
/// proportional to the line's length, once the chunk holds [`CHUNK_MIN`]
/// bytes; or once it holds [`CHUNK_MAX`]. The cuts depend on the lines
/// around them only: a new file changes its own chunk (and now and then
/// the next one), not the others.
pub fn plan_chunks(lines: &[&[u8]]) -> Vec<std::ops::Range<usize>> {
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, line) in lines.iter().enumerate() {
        let len = line.len() as u64;
        bytes += len;
        let path = line.split(|&c| c == b' ').next().unwrap_or(line);
        let h = u64::from_le_bytes(Sha256::digest(path)[..8].try_into().expect("8 bytes"));
        // P(cut) = len / CHUNK_SPREAD: on average CHUNK_SPREAD bytes past
        // the minimum, whatever the lines' lengths.
        let hit = (h as u128) * (CHUNK_SPREAD as u128) < (len as u128 + 1) << 64;
        if (bytes >= CHUNK_MIN && hit) || bytes >= CHUNK_MAX {
            chunks.push(start..i + 1);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < lines.len() {
        chunks.push(start..lines.len());
    }
    chunks
}

/// The chunk blobs of `tree` (whose image has format version
/// `erofs_version`), its objects placed by `place` in `packs` (a
/// [`Location`]'s pack is a number in `packs`). `None` where the tree does
/// not print, or an object is not placed.
pub fn encode(
    tree: &Tree,
    erofs_version: u32,
    packs: &[Digest],
    place: impl Fn(&[u8; 32]) -> Option<Location>,
) -> Option<Vec<Vec<u8>>> {
    cut(tree, erofs_version, |chunk, objects| {
        for d in objects.iter().flatten() {
            let loc = place(d)?;
            let pack = packs.get(loc.pack as usize)?.to_string();
            let n = match chunk.packs.iter().position(|p| *p == pack) {
                Some(n) => n,
                None => {
                    chunk.packs.push(pack);
                    chunk.packs.len() - 1
                }
            };
            let stored = match loc.stored {
                Stored::Raw => 0,
                Stored::Zstd(n) => n,
            };
            chunk.objects.push((n as u32, loc.offset, stored));
        }
        Some(())
    })
}

/// The chunk blobs of `tree`'s lines alone, no object placed: a `tilefs
/// index`'s image, whose files its layer maps place.
pub fn encode_lines(tree: &Tree, erofs_version: u32) -> Option<Vec<Vec<u8>>> {
    cut(tree, erofs_version, |_, _| Some(()))
}

/// `tree`'s lines cut into chunks, each given its objects by `place`
/// (the objects of its lines' files), and encoded.
fn cut(
    tree: &Tree,
    erofs_version: u32,
    mut place: impl FnMut(&mut Chunk, &[Option<[u8; 32]>]) -> Option<()>,
) -> Option<Vec<Vec<u8>>> {
    let (dump, objects) = lines_of(tree)?;
    let lines: Vec<&[u8]> = dump.split_inclusive(|&c| c == b'\n').collect();
    if lines.len() != objects.len() {
        return None;
    }
    let mut out = Vec::new();
    for range in plan_chunks(&lines) {
        let mut chunk = Chunk {
            version: VERSION,
            erofs_version,
            packs: Vec::new(),
            dump: String::from_utf8(lines[range.clone()].concat()).ok()?,
            objects: Vec::new(),
        };
        place(&mut chunk, &objects[range])?;
        out.push(encode_chunk(&chunk));
    }
    Some(out)
}

/// Whether chunk blobs `chunks` rebuild `image` (fs-verity digest
/// `fsverity`, hex) byte for byte, their objects in `packs`: what a pull
/// will do, done before a push sends them.
pub fn rebuilds(chunks: &[Vec<u8>], packs: &[Digest], image: &[u8], fsverity: &str) -> bool {
    let decoded: Result<Vec<_>, _> = chunks.iter().map(|c| decode(c, "tree chunk")).collect();
    let names = vec![String::new(); chunks.len()];
    decoded
        .and_then(|d| rebuild(&d, &names, packs, "this image", Some(fsverity)))
        .is_ok_and(|r| r.image == image)
}

/// A chunk's blob.
pub fn encode_chunk(chunk: &Chunk) -> Vec<u8> {
    let raw = postcard::to_stdvec(chunk).expect("a chunk serializes");
    zstd::bulk::compress(&raw, artifact::LEVEL).expect("zstd compresses in memory")
}

/// Decodes a chunk blob (`what` names it in errors): zstd of a [`Chunk`]
/// of this format, its dump whole lines, each object in one of its packs.
pub fn decode(blob: &[u8], what: &str) -> Result<Chunk, OciError> {
    let bad = |r: String| OciError::blob(what, format!("tree chunk: {r}"));
    let raw = artifact::unzstd(blob, MAX_CHUNK).map_err(bad)?;
    let chunk: Chunk = postcard::from_bytes(&raw).map_err(|e| bad(format!("not a tilefs tree chunk: {e}")))?;
    if chunk.version != VERSION {
        return Err(bad(format!(
            "format version {} where its media type says {VERSION}",
            chunk.version
        )));
    }
    if !chunk.dump.ends_with('\n') {
        return Err(bad("its lines do not end in a newline".into()));
    }
    if let Some(&(p, _, _)) = chunk.objects.iter().find(|o| o.0 as usize >= chunk.packs.len()) {
        return Err(bad(format!(
            "an object lies in its pack {p}, but it names {} packs",
            chunk.packs.len()
        )));
    }
    Ok(chunk)
}

/// An image rebuilt from its chunks, and where its objects lie.
pub struct Rebuilt {
    pub image: Vec<u8>,
    pub digest: [u8; 32],
    pub version: u32,
    /// Per external file's primary entry, in line order: the pack (a
    /// number among the artifact's packs), offset, stored bytes (0: raw).
    pub objects: Vec<(u32, u64, u64)>,
}

/// Rebuilds the image of `chunks` (decoded, in order; `names` name them),
/// whose packs are `packs` (the artifact's, in its manifest's order).
/// `artifact` names the artifact in errors; `fsverity` is the digest the
/// artifact records, if the image must have one.
pub fn rebuild(
    chunks: &[Chunk],
    names: &[String],
    packs: &[Digest],
    artifact: &str,
    fsverity: Option<&str>,
) -> Result<Rebuilt, OciError> {
    let Some(first) = chunks.first() else {
        return Err(OciError::manifest(artifact, "its tree has no chunks"));
    };
    let packs: Vec<String> = packs.iter().map(|d| d.to_string()).collect();
    let mut dump = Vec::with_capacity(chunks.iter().map(|c| c.dump.len()).sum());
    let mut objects = Vec::new();
    for (c, name) in chunks.iter().zip(names) {
        if c.erofs_version != first.erofs_version {
            return Err(OciError::blob(
                name,
                format!(
                    "tree chunk: EROFS format version {} where the first chunk says {}",
                    c.erofs_version, first.erofs_version
                ),
            ));
        }
        let mut at = Vec::with_capacity(c.packs.len());
        for p in &c.packs {
            match packs.iter().position(|q| q == p) {
                Some(n) => at.push(n as u32),
                None => {
                    return Err(OciError::blob(
                        name,
                        format!("tree chunk: its objects lie in pack {p}, which {artifact} does not have"),
                    ))
                }
            }
        }
        dump.extend_from_slice(c.dump.as_bytes());
        for &(p, off, stored) in &c.objects {
            let Some(&pack) = at.get(p as usize) else {
                return Err(OciError::blob(
                    name,
                    format!(
                        "tree chunk: an object lies in its pack {p}, but it names {} packs",
                        at.len()
                    ),
                ));
            };
            objects.push((pack, off, stored));
        }
    }
    let refused = |r: String| OciError::manifest(artifact, format!("its image cannot be rebuilt from its tree: {r}"));
    let flat = tilefs_image::dump::parse_flat(&dump[..], Default::default()).map_err(|e| refused(e.to_string()))?;
    drop(dump);
    let opts = tilefs_image::erofs::writer::WriteOptions {
        min_version: first.erofs_version,
        max_version: first.erofs_version,
    };
    let (image, version) = tilefs_image::erofs::writer::write_flat(&flat, &opts).map_err(|e| refused(e.to_string()))?;
    let digest = tilefs_image::verity::digest_bytes(&image);
    if let Some(want) = fsverity {
        if hex::encode(digest) != want {
            return Err(OciError::manifest(
                artifact,
                format!(
                    "the image rebuilt from its tree has fs-verity digest {}, but the artifact records {want}: \
                     refused",
                    hex::encode(digest)
                ),
            ));
        }
    }
    Ok(Rebuilt {
        image,
        digest,
        version,
        objects,
    })
}

/// The object index of an image rebuilt from chunks: its `tree` (read
/// from the image) and where the chunks place its external files
/// (`placed`, in line order), checked as a format 2 index is: one place
/// for each object, inside its pack (`pack_sizes`), a compressed one
/// smaller than the object.
pub fn index_of(
    tree: &Tree,
    placed: &[(u32, u64, u64)],
    pack_sizes: &[u64],
    what: &str,
) -> Result<ObjectIndex, OciError> {
    let bad = |r: String| OciError::manifest(what, r);
    let files: Vec<([u8; 32], u64)> = {
        let mut out = Vec::new();
        tree.walk(|_, entry, id| {
            let inode = tree.inode(id);
            if entry.is_some_and(|e| e.hardlink) || !inode.is_external() {
                return;
            }
            if let Some(d) = inode.payload.as_deref().and_then(parse_object_rel) {
                out.push((d, inode.size));
            }
        });
        out
    };
    if files.len() != placed.len() {
        return Err(bad(format!(
            "its tree places {} files' objects, the image has {} such files",
            placed.len(),
            files.len()
        )));
    }
    let mut objects: Vec<([u8; 32], Location)> = Vec::with_capacity(files.len());
    for (&(digest, size), &(pack, offset, stored)) in files.iter().zip(placed) {
        let name = || hex::encode(digest);
        let loc = Location {
            pack,
            offset,
            size,
            stored: match stored {
                0 => Stored::Raw,
                n if n < size => Stored::Zstd(n),
                n => {
                    return Err(bad(format!(
                        "object {} of {size} bytes is stored compressed in {n} bytes (no fewer)",
                        name()
                    )))
                }
            },
        };
        let Some(&pack_size) = pack_sizes.get(pack as usize) else {
            return Err(bad(format!(
                "object {} lies in pack {pack}, but the artifact has {} packs",
                name(),
                pack_sizes.len()
            )));
        };
        if offset.checked_add(loc.stored_len()).is_none_or(|end| end > pack_size) {
            return Err(bad(format!(
                "object {} at offset {offset}, {} bytes, lies outside pack {pack} ({pack_size} bytes)",
                name(),
                loc.stored_len()
            )));
        }
        objects.push((digest, loc));
    }
    objects.sort_unstable_by_key(|o| o.0);
    objects.dedup();
    if let Some(w) = objects.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!("object {} is placed in two places", hex::encode(w[0].0))));
    }
    Ok(ObjectIndex { objects })
}

/// Fetches the chunk blobs `chunks` through `t`, several at once, each
/// checked against its digest, and decodes them.
pub fn fetch(t: &dyn Transport, chunks: &[BlobRef]) -> Result<Vec<Chunk>, OciError> {
    let next = AtomicUsize::new(0);
    let out: Vec<Mutex<Option<Result<Chunk, OciError>>>> = chunks.iter().map(|_| Mutex::new(None)).collect();
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..JOBS.min(chunks.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Relaxed);
                let Some(b) = chunks.get(i) else { break };
                if failed.load(Relaxed) {
                    break;
                }
                let what = b.digest.to_string();
                let got = t
                    .open_blob(b)
                    .and_then(|r| {
                        read_checked(
                            r,
                            &b.digest,
                            b.size.unwrap_or(MAX_CHUNK_BLOB).min(MAX_CHUNK_BLOB),
                            "tree chunk",
                        )
                    })
                    .and_then(|bytes| decode(&bytes, &what));
                failed.fetch_or(got.is_err(), Relaxed);
                *out[i].lock().unwrap() = Some(got);
            });
        }
    });
    // The first failure in the artifact's order (not the first to come).
    let mut decoded = Vec::with_capacity(chunks.len());
    for r in out.into_iter().filter_map(|m| m.into_inner().unwrap()) {
        decoded.push(r?);
    }
    if decoded.len() != chunks.len() {
        return Err(OciError::Interrupted);
    }
    Ok(decoded)
}

/// An artifact of format 3 whose blobs are `layers`, opened through `t`:
/// its chunks fetched, its image rebuilt and checked against
/// `config.fsverity`, its objects placed. `what` names it.
pub fn open(
    t: &dyn Transport,
    layers: &[BlobRef],
    runnable: bool,
    config: Option<&artifact::Config>,
    what: &str,
) -> Result<crate::fetch::RemoteImage, OciError> {
    let (tree_type, pack_type) = artifact::tree_types(runnable);
    let n = layers.iter().take_while(|l| l.media_type == tree_type).count();
    let (chunks, packs) = layers.split_at(n);
    if let Some(b) = packs.iter().find(|b| b.media_type != pack_type) {
        return Err(OciError::manifest(
            what,
            format!(
                "blob {} has media type {} where {pack_type} was expected",
                b.digest, b.media_type
            ),
        ));
    }
    let decoded = fetch(t, chunks)?;
    let names: Vec<String> = chunks.iter().map(|c| c.digest.to_string()).collect();
    let pack_digests: Vec<Digest> = packs.iter().map(|p| p.digest.clone()).collect();
    let rebuilt = rebuild(
        &decoded,
        &names,
        &pack_digests,
        what,
        config.map(|c| c.fsverity.as_str()),
    )?;
    drop(decoded);
    let (tree, info) = tilefs_image::erofs::read_image(&rebuilt.image)
        .map_err(|e| OciError::manifest(what, format!("its rebuilt image cannot be read: {e}")))?;
    let sizes: Vec<u64> = packs.iter().map(|p| p.size.unwrap_or(0)).collect();
    let index = index_of(&tree, &rebuilt.objects, &sizes, what)?;
    let objects = artifact::objects_of(&tree);
    Ok(crate::fetch::RemoteImage {
        entries: tree.inodes.len(),
        image: rebuilt.image,
        digest: rebuilt.digest,
        objects,
        index,
        packs: packs.to_vec(),
        version: info.version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tilefs_image::tree::{Inode, S_IFDIR, S_IFREG};

    /// A tree of `n` files in 10 directories, each file an object.
    fn tree(n: u32, extra: Option<&[u8]>) -> Tree {
        let mut t = Tree::new(Inode::new(S_IFDIR | 0o755));
        let dirs: Vec<_> = (0..10)
            .map(|d| {
                t.add_child(0, format!("dir{d}").as_bytes(), Inode::new(S_IFDIR | 0o755))
                    .unwrap()
            })
            .collect();
        let add = |t: &mut Tree, name: &[u8], dir| {
            let d: [u8; 32] = Sha256::digest(name).into();
            let mut f = Inode::new(S_IFREG | 0o644);
            f.size = 1000;
            f.digest = Some(d);
            f.payload = Some(tilefs_image::tree::digest_object_path(&d).into_bytes());
            t.add_child(dir, name, f).unwrap();
        };
        for i in 0..n {
            add(
                &mut t,
                format!("file-{i:06}-with-a-longer-name").as_bytes(),
                dirs[(i % 10) as usize],
            );
        }
        if let Some(name) = extra {
            add(&mut t, name, dirs[3]);
        }
        t
    }

    fn chunks_of(t: &Tree, packs: &[Digest]) -> Vec<Vec<u8>> {
        encode(t, 0, packs, |d| {
            Some(Location {
                pack: u32::from(d[0] % 2),
                offset: u64::from(d[1]) * 1000,
                size: 1000,
                stored: if d[2] % 2 == 0 { Stored::Raw } else { Stored::Zstd(500) },
            })
        })
        .unwrap()
    }

    #[test]
    fn an_image_rebuilds_from_its_chunks_and_a_new_file_changes_few_of_them() {
        let packs = [Digest::sha256_of(b"p0"), Digest::sha256_of(b"p1")];
        let t = tree(20_000, None);
        let image = tilefs_image::erofs::writer::write_image(&t, &Default::default()).unwrap();
        let blobs = chunks_of(&t, &packs);
        assert!(blobs.len() > 4, "{} chunks", blobs.len());
        let decoded: Vec<Chunk> = blobs.iter().map(|b| decode(b, "c").unwrap()).collect();
        let names: Vec<String> = (0..decoded.len()).map(|i| format!("chunk {i}")).collect();
        let want = hex::encode(image.digest);
        let r = rebuild(&decoded, &names, &packs, "art", Some(&want)).unwrap();
        assert!(r.image == image.bytes);
        let index = index_of(&t, &r.objects, &[256_000, 256_000], "art").unwrap();
        assert_eq!(index.objects.len(), 20_000);
        // Packs named by digest: another order of the artifact's packs
        // places the objects in the same packs.
        let swapped = [packs[1].clone(), packs[0].clone()];
        let r2 = rebuild(&decoded, &names, &swapped, "art", None).unwrap();
        assert!(r.objects.iter().zip(&r2.objects).all(|(a, b)| a.0 == 1 - b.0));
        // One file more: most chunks are the same blobs.
        let more = chunks_of(&tree(20_000, Some(b"file-010000-added")), &packs);
        let new = more.iter().filter(|b| !blobs.contains(b)).count();
        assert!((1..=2).contains(&new), "{new} new chunks of {}", more.len());
        // A chunk changed: the image is refused, naming the artifact.
        let mut lying = decoded.clone();
        lying[1].dump = lying[1].dump.replacen(" 100644 ", " 100755 ", 1);
        let e = rebuild(&lying, &names, &packs, "art", Some(&want))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("art") && e.contains("refused"), "{e}");
        // A pack the artifact lacks, a place outside its pack.
        let e = rebuild(&decoded, &names, &packs[..1], "art", None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("chunk ") && e.contains("does not have"), "{e}");
        let e = index_of(&t, &r.objects, &[1000, 1000], "art").unwrap_err().to_string();
        assert!(e.contains("outside pack"), "{e}");
        let e = index_of(&t, &r.objects[1..], &[256_000, 256_000], "art")
            .unwrap_err()
            .to_string();
        assert!(e.contains("places 19999"), "{e}");
    }

    #[test]
    fn bad_chunks_are_refused() {
        let chunk = encode_chunk;
        let good = Chunk {
            version: VERSION,
            erofs_version: 0,
            packs: vec![],
            dump: "/ 0 40755 2 0 0 0 0.0 - - -\n".into(),
            objects: vec![],
        };
        assert_eq!(decode(&chunk(&good), "c").unwrap(), good);
        for (c, why) in [
            (
                Chunk {
                    version: 2,
                    ..good.clone()
                },
                "format version 2",
            ),
            (
                Chunk {
                    dump: "/ 0".into(),
                    ..good.clone()
                },
                "newline",
            ),
            (
                Chunk {
                    objects: vec![(0, 0, 0)],
                    ..good.clone()
                },
                "names 0 packs",
            ),
        ] {
            let e = decode(&chunk(&c), "sha256:ab").unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("sha256:ab"), "{e}");
        }
        assert!(decode(b"not zstd", "c").is_err());
        assert!(rebuild(&[], &[], &[], "art", None).is_err());
    }
}
