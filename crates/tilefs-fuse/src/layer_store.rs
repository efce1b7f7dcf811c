//! An additional layer store for containers/storage (podman): one FUSE
//! filesystem in which `<base64 of an image reference>/<layer digest>/`
//! appears when looked up, if the layer can be served lazily, with
//!
//! - `diff/`: the layer's own files (whiteouts and opaque directories as
//!   overlayfs takes them of a lower layer), served by a [`TileFs`] of the
//!   layer's image: each file fetched on its first read into the store and
//!   checked against the image's digest before a byte is served;
//! - `info`: the layer's record as containers/storage decodes it;
//! - `blob`: the layer blob, read by range from where it lives.
//!
//! The base64 of a reference may contain `/`: each component below the
//! root is a directory of the reference's encoding so far, until one names
//! a digest. What a layer is, is the [`LayerSource`]'s to say (the
//! registry, its credentials, the signature policy); a layer it cannot
//! serve is ENOENT, and containers/storage then pulls it itself.
//!
//! containers/storage tells the store when it starts and stops using a
//! layer: it creates and removes `use` in the layer's directory, and
//! rmdirs the directory on release. A store that takes these notices
//! answers both with ENOENT (anything else makes it warn); the
//! [`LayerSource`] hears of each.
//!
//! Node ids: the store's own nodes (the root, the reference's directories,
//! the layers' directories, `info`, `blob`) are numbered from 1 below
//! [`LAYER_SPAN`]; layer k's image is served with node ids from
//! `(k + 1) * LAYER_SPAN` on (see `Lower::base`), so its [`TileFs`]
//! answers requests for them as they come.

use crate::fs::TileFs;
use crate::{Fetcher, FuseError, ServeSpec, Tuning};
use base64::Engine;
use rustc_hash::FxHashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tilefs_fuse_proto::abi::{self, init};
use tilefs_fuse_proto::{Connection, DirBuf, Entry, Filesystem, InitConfig, KernelInit, Op, Reply, Request, Ttl};

/// Node ids of each layer's image (and below it, the store's own).
pub const LAYER_SPAN: u64 = 1 << 40;
/// The longest base64 of a reference accepted (a reference is at most a
/// few hundred bytes).
const MAX_ENCODED: usize = 4096;
/// How long a layer found unservable is answered ENOENT without asking the
/// source again (each of podman's path walks looks it up once more).
const NEGATIVE_FOR: Duration = Duration::from_secs(30);
/// Validity of the store's own entries: short, as the layers behind them
/// come and go.
const SHORT: Ttl = Ttl::from_secs(1);

/// A layer served: its image, how its absent files are fetched, its
/// containers/storage record and its blob.
pub struct LayerFiles {
    /// The layer's image (an EROFS image of its diff), a file.
    pub image: PathBuf,
    pub fetcher: Option<Fetcher>,
    /// `info`: the layer record (JSON) containers/storage decodes.
    pub info: Vec<u8>,
    pub blob_size: u64,
    pub blob: Arc<dyn BlobReader>,
}

/// Reads the layer blob.
pub trait BlobReader: Send + Sync {
    /// Up to `len` bytes at `offset` (fewer only at the end).
    fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, String>;
}

/// What the layers are: called from the server's threads, and may block
/// (a registry's round trips).
pub trait LayerSource: Send + Sync {
    /// Layer `digest` of image `reference`, if it can be served lazily;
    /// None leaves it to containers/storage. An error is logged and
    /// answered as None.
    fn layer(&self, reference: &str, digest: &str) -> Result<Option<LayerFiles>, String>;
    /// containers/storage started using the layer (`use` created).
    fn used(&self, reference: &str, digest: &str) -> Result<(), String>;
    /// containers/storage stopped using it (its directory rmdir'ed).
    /// True when that was its last use: the layer is no longer kept, and
    /// a later lookup asks for it again.
    fn released(&self, reference: &str, digest: &str) -> Result<bool, String>;
    /// What refusals depend on besides the layer (the state of the
    /// credential files): a refusal is remembered only while it is the
    /// same, so a `podman login` is seen at the next lookup.
    fn epoch(&self) -> u64 {
        0
    }
}

/// A layer by (reference, digest).
type Key = (String, String);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Node {
    Root,
    /// A directory of a reference's encoding (its components so far).
    Encoded(String),
    /// A layer's directory, its `info` and its `blob` (by layer number).
    Layer(usize),
    Info(usize),
    Blob(usize),
}

struct Layer {
    reference: String,
    digest: String,
    files: LayerFiles,
    fs: TileFs,
}

#[derive(Default)]
struct Nodes {
    by_id: FxHashMap<u64, Node>,
    by_node: FxHashMap<Node, u64>,
    next: u64,
}

impl Nodes {
    fn id_of(&mut self, n: Node) -> u64 {
        if let Some(&id) = self.by_node.get(&n) {
            return id;
        }
        self.next += 1;
        let id = self.next;
        self.by_id.insert(id, n.clone());
        self.by_node.insert(n, id);
        id
    }
}

/// The layer store's filesystem.
pub struct LayerStoreFs {
    source: Arc<dyn LayerSource>,
    store: PathBuf,
    tuning: Tuning,
    nodes: Mutex<Nodes>,
    layers: RwLock<Vec<Arc<Layer>>>,
    /// Layers by (reference, digest): their number.
    by_key: Mutex<FxHashMap<Key, usize>>,
    /// Layers found unservable lately, and when.
    /// When each was refused, and the source's epoch then.
    refused: Mutex<FxHashMap<Key, (Instant, u64)>>,
    /// One lookup of a layer at a time (others wait for its answer).
    resolving: Mutex<FxHashMap<Key, Arc<Mutex<()>>>>,
    owner: (u32, u32),
    started: u64,
    /// Layers opened so far: the heap is trimmed once a batch of them
    /// (podman looks an image's layers up one after another) is done.
    opened: Arc<AtomicU64>,
}

/// How long after the last layer opened the heap is trimmed: the
/// lookups of one image come closer together than this.
const TRIM_AFTER: Duration = Duration::from_millis(500);

impl LayerStoreFs {
    /// A layer store over the tilefs store at `store`, its layers from
    /// `source`.
    pub fn new(store: PathBuf, source: Arc<dyn LayerSource>) -> Result<LayerStoreFs, FuseError> {
        let mut nodes = Nodes {
            next: 1,
            ..Nodes::default()
        };
        nodes.by_id.insert(1, Node::Root);
        nodes.by_node.insert(Node::Root, 1);
        Ok(LayerStoreFs {
            source,
            store,
            // Passthrough is left out: backing files are registered per
            // mount, and layers come and go.
            tuning: Tuning {
                passthrough: false,
                ..Tuning::default()
            }
            .from_env()?,
            nodes: Mutex::new(nodes),
            layers: RwLock::new(Vec::new()),
            by_key: Mutex::new(FxHashMap::default()),
            refused: Mutex::new(FxHashMap::default()),
            resolving: Mutex::new(FxHashMap::default()),
            owner: (rustix::process::geteuid().as_raw(), rustix::process::getegid().as_raw()),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            opened: Arc::new(AtomicU64::new(0)),
        })
    }

    fn node(&self, ino: u64) -> Option<Node> {
        self.nodes.lock().unwrap().by_id.get(&ino).cloned()
    }

    fn layer(&self, k: usize) -> Option<Arc<Layer>> {
        self.layers.read().unwrap().get(k).cloned()
    }

    fn attr(&self, ino: u64, n: &Node) -> abi::Attr {
        let (mode, size) = match n {
            Node::Info(k) => (
                libc::S_IFREG | 0o444,
                self.layer(*k).map_or(0, |l| l.files.info.len() as u64),
            ),
            Node::Blob(k) => (libc::S_IFREG | 0o444, self.layer(*k).map_or(0, |l| l.files.blob_size)),
            _ => (libc::S_IFDIR | 0o755, 0),
        };
        abi::Attr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            mode,
            nlink: if mode & libc::S_IFMT == libc::S_IFDIR { 2 } else { 1 },
            uid: self.owner.0,
            gid: self.owner.1,
            blksize: 4096,
            ..abi::Attr::default()
        }
    }

    fn entry(&self, n: Node) -> Entry {
        let id = self.nodes.lock().unwrap().id_of(n.clone());
        Entry {
            nodeid: id,
            generation: 0,
            entry_ttl: SHORT,
            attr_ttl: SHORT,
            attr: self.attr(id, &n),
        }
    }

    /// The reference a directory's encoding names, if it is one.
    fn reference(encoded: &str) -> Option<String> {
        let raw = base64::engine::general_purpose::STANDARD.decode(encoded).ok()?;
        String::from_utf8(raw)
            .ok()
            .filter(|r| !r.is_empty() && !r.contains('\0'))
    }

    fn is_digest(name: &str) -> bool {
        name.strip_prefix("sha256:")
            .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    }

    /// Layer `digest` of `reference`, served from now on, if it can be.
    fn find_layer(&self, reference: &str, digest: &str) -> Option<usize> {
        let key = (reference.to_string(), digest.to_string());
        if let Some(&k) = self.by_key.lock().unwrap().get(&key) {
            return Some(k);
        }
        let epoch = self.source.epoch();
        if self
            .refused
            .lock()
            .unwrap()
            .get(&key)
            .is_some_and(|&(t, e)| t.elapsed() < NEGATIVE_FOR && e == epoch)
        {
            return None;
        }
        let slot = self.resolving.lock().unwrap().entry(key.clone()).or_default().clone();
        let _one = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&k) = self.by_key.lock().unwrap().get(&key) {
            return Some(k);
        }
        tilefs_fuse_proto::may_block();
        let found = self.source.layer(reference, digest).and_then(|f| match f {
            Some(files) => self.serve(reference, digest, files).map(Some),
            None => Ok(None),
        });
        self.resolving.lock().unwrap().remove(&key);
        match found {
            Ok(Some(k)) => Some(k),
            Ok(None) => {
                self.refuse(key, epoch);
                None
            }
            Err(e) => {
                tracing::warn!("{reference} layer {digest}: {e}");
                self.refuse(key, epoch);
                None
            }
        }
    }

    /// Remembers a refusal for [NEGATIVE_FOR]; those past it are dropped
    /// so the map holds only what is still remembered.
    fn refuse(&self, key: Key, epoch: u64) {
        let mut refused = self.refused.lock().unwrap();
        refused.retain(|_, (t, _)| t.elapsed() < NEGATIVE_FOR);
        refused.insert(key, (Instant::now(), epoch));
    }

    /// Starts serving a layer: its image read and checked.
    fn serve(&self, reference: &str, digest: &str, files: LayerFiles) -> Result<usize, String> {
        let spec = ServeSpec {
            fetcher: files.fetcher.clone(),
            ..ServeSpec::new(&files.image, &self.store)
        };
        let mut layers = self.layers.write().unwrap();
        let k = layers.len();
        let mut lower = crate::open_lower(&spec, &self.tuning, false).map_err(|e| e.to_string())?;
        lower.base = (k as u64 + 1) * LAYER_SPAN;
        let fs = TileFs::new(lower, self.tuning, crate::nofile_limit() / 2);
        layers.push(Arc::new(Layer {
            reference: reference.to_string(),
            digest: digest.to_string(),
            files,
            fs,
        }));
        drop(layers);
        self.trim_later();
        self.by_key
            .lock()
            .unwrap()
            .insert((reference.to_string(), digest.to_string()), k);
        Ok(k)
    }

    /// Gives the heap's free memory back once no layer was opened for
    /// [`TRIM_AFTER`]: what a layer's making freed (its table parsed, its
    /// image written) is returned once per batch, not per layer, whose
    /// lookup it would slow (malloc_trim walks every arena).
    fn trim_later(&self) {
        let opened = self.opened.clone();
        let mine = opened.fetch_add(1, Ordering::Relaxed) + 1;
        let spawned = std::thread::Builder::new().name("trim".into()).spawn(move || {
            std::thread::sleep(TRIM_AFTER);
            if opened.load(Ordering::Relaxed) == mine {
                tilefs_sys::mem::trim_heap();
            }
        });
        // Without a thread (none to spare), now.
        if spawned.is_err() {
            tilefs_sys::mem::trim_heap();
        }
    }

    /// Whether `req` comes from the store's owner (containers/storage runs
    /// as it). Only the owner may make the store resolve references or
    /// take notices: with `allow_other` any local user can look names up,
    /// and must not make root's store reach registries or grow its tables.
    fn is_owner(&self, req: &Request) -> bool {
        req.uid == self.owner.0
    }

    fn lookup(&self, req: &Request, parent: &Node, name: &str, reply: Reply<'_>) {
        match parent {
            Node::Root | Node::Encoded(_) => {
                if !self.is_owner(req) {
                    return reply.error(libc::ENOENT);
                }
                let prefix = match parent {
                    Node::Encoded(p) => p.as_str(),
                    _ => "",
                };
                if Self::is_digest(name) {
                    let Some(reference) = Self::reference(prefix) else {
                        return reply.error(libc::ENOENT);
                    };
                    return match self.find_layer(&reference, name) {
                        Some(k) => reply.entry(&self.entry(Node::Layer(k))),
                        None => reply.error(libc::ENOENT),
                    };
                }
                let base64_chars = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=');
                if name.is_empty() || !name.bytes().all(base64_chars) || prefix.len() + name.len() >= MAX_ENCODED {
                    return reply.error(libc::ENOENT);
                }
                let encoded = if prefix.is_empty() {
                    name.to_string()
                } else {
                    format!("{prefix}/{name}")
                };
                reply.entry(&self.entry(Node::Encoded(encoded)))
            }
            Node::Layer(k) => match (name, self.layer(*k)) {
                ("diff", Some(l)) => match l.fs.lower.try_entry(tilefs_image::tree::ROOT) {
                    Ok(e) => reply.entry(&e),
                    Err(e) => reply.error(e),
                },
                ("info", Some(_)) => reply.entry(&self.entry(Node::Info(*k))),
                ("blob", Some(_)) => reply.entry(&self.entry(Node::Blob(*k))),
                _ => reply.error(libc::ENOENT),
            },
            Node::Info(_) | Node::Blob(_) => reply.error(libc::ENOTDIR),
        }
    }

    fn readdir(&self, n: &Node, offset: u64, size: u32, plus: bool, reply: Reply<'_>) {
        let mut names: Vec<(&[u8], Entry)> = vec![(b".", self.entry(n.clone())), (b"..", self.entry(n.clone()))];
        if let (Node::Layer(k), Some(l)) = (n, self.layer_of(n)) {
            if let Ok(e) = l.fs.lower.try_entry(tilefs_image::tree::ROOT) {
                names.push((b"diff", e));
            }
            names.push((b"info", self.entry(Node::Info(*k))));
            names.push((b"blob", self.entry(Node::Blob(*k))));
        }
        let mut buf = DirBuf::new(size);
        for (i, (name, e)) in names.iter().enumerate().skip(offset as usize) {
            let off = i as u64 + 1;
            let typ = (e.attr.mode & libc::S_IFMT) >> 12;
            let full = if plus {
                buf.add_plus(e, off, typ, name)
            } else {
                buf.add(e.nodeid, off, typ, name)
            };
            if full {
                break;
            }
        }
        reply.data(buf.as_bytes())
    }

    fn layer_of(&self, n: &Node) -> Option<Arc<Layer>> {
        match n {
            Node::Layer(k) | Node::Info(k) | Node::Blob(k) => self.layer(*k),
            _ => None,
        }
    }

    fn read(&self, n: &Node, offset: u64, size: u32, reply: Reply<'_>) {
        match (n, self.layer_of(n)) {
            (Node::Info(_), Some(l)) => {
                let data = &l.files.info;
                let start = offset.min(data.len() as u64) as usize;
                let end = start.saturating_add(size as usize).min(data.len());
                reply.data(&data[start..end])
            }
            (Node::Blob(_), Some(l)) => {
                let len = l.files.blob_size.saturating_sub(offset).min(u64::from(size)) as usize;
                if len == 0 {
                    return reply.data(&[]);
                }
                tilefs_fuse_proto::may_block();
                match l.files.blob.read_at(offset, len) {
                    Ok(data) => reply.data(&data),
                    Err(e) => {
                        tracing::warn!("{} layer {}: reading its blob: {e}", l.reference, l.digest);
                        reply.error(libc::EIO)
                    }
                }
            }
            (Node::Layer(_) | Node::Root | Node::Encoded(_), _) => reply.error(libc::EISDIR),
            _ => reply.error(libc::ENOENT),
        }
    }

    /// The layer a directory entry of `parent` names (for rmdir).
    fn layer_named(&self, parent: &Node, name: &str) -> Option<Arc<Layer>> {
        let Node::Encoded(prefix) = parent else {
            return None;
        };
        let reference = Self::reference(prefix)?;
        let k = *self.by_key.lock().unwrap().get(&(reference, name.to_string()))?;
        self.layer(k)
    }
}

impl Filesystem for LayerStoreFs {
    fn init(&self, _kernel: &KernelInit, _conn: &Arc<Connection>) -> InitConfig {
        let mut want = init::ASYNC_READ | init::PARALLEL_DIROPS | init::BIG_WRITES;
        if self.tuning.cache_symlinks {
            want |= init::CACHE_SYMLINKS;
        }
        if self.tuning.readdirplus {
            want |= init::DO_READDIRPLUS;
        }
        if self.tuning.max_pages {
            want |= init::MAX_PAGES;
        }
        InitConfig {
            want,
            max_write: if self.tuning.max_pages { 1 << 20 } else { 128 * 1024 },
            max_background: 64,
            congestion_threshold: 48,
            ..InitConfig::default()
        }
    }

    fn handle(&self, req: &Request, op: Op<'_>, reply: Reply<'_>) {
        let ino = req.nodeid;
        if ino >= LAYER_SPAN {
            // A node of a layer's image: its filesystem answers.
            return match self.layer((ino / LAYER_SPAN - 1) as usize) {
                Some(l) => l.fs.handle(req, op, reply),
                None => reply.error(libc::ENOENT),
            };
        }
        let Some(n) = self.node(ino) else {
            return reply.error(libc::ENOENT);
        };
        let name_of = |s: &std::ffi::OsStr| s.to_str().unwrap_or("").to_string();
        match op {
            Op::Lookup { name } => self.lookup(req, &n, &name_of(name), reply),
            Op::Getattr { .. } => reply.attr(SHORT, &self.attr(ino, &n)),
            Op::Opendir { .. } if self.tuning.no_opendir => reply.error(libc::ENOSYS),
            Op::Open { .. } if self.tuning.no_open && self.tuning.keep_cache => reply.error(libc::ENOSYS),
            Op::Opendir { .. } | Op::Open { .. } => reply.open(tilefs_fuse_proto::Open {
                fh: 0,
                flags: 0,
                backing_id: 0,
            }),
            Op::Readdir { arg, plus } => match n {
                Node::Info(_) | Node::Blob(_) => reply.error(libc::ENOTDIR),
                _ => self.readdir(&n, arg.offset, arg.size, plus, reply),
            },
            Op::Read(a) => self.read(&n, a.offset, a.size, reply),
            // containers/storage's notices: heard, and answered ENOENT as
            // it expects of a store that takes them.
            Op::Create { .. } | Op::Mknod { .. } | Op::Unlink { .. } | Op::Rmdir { .. } if !self.is_owner(req) => {
                reply.error(libc::EACCES)
            }
            Op::Create { name, .. } | Op::Mknod { name, .. } if name_of(name) == "use" => {
                if let Some(l) = self.layer_of(&n).filter(|_| matches!(n, Node::Layer(_))) {
                    if let Err(e) = self.source.used(&l.reference, &l.digest) {
                        tracing::warn!("{} layer {}: {e}", l.reference, l.digest);
                    }
                }
                reply.error(libc::ENOENT)
            }
            Op::Unlink { name } if name_of(name) == "use" => reply.error(libc::ENOENT),
            Op::Rmdir { name } => {
                if let Some(l) = self.layer_named(&n, &name_of(name)) {
                    let last = self.source.released(&l.reference, &l.digest).unwrap_or_else(|e| {
                        tracing::warn!("{} layer {}: {e}", l.reference, l.digest);
                        false
                    });
                    if last {
                        // Its image stays served under its node ids for
                        // whoever still has it open.
                        self.by_key
                            .lock()
                            .unwrap()
                            .remove(&(l.reference.clone(), l.digest.clone()));
                    }
                }
                reply.error(libc::ENOENT)
            }
            Op::Getxattr { .. } => reply.error(libc::ENODATA),
            Op::Listxattr { size } => crate::fs::xattr_reply(&[], size, reply),
            Op::Statfs => reply.statfs(&abi::Kstatfs {
                bsize: 4096,
                frsize: 4096,
                namelen: 255,
                ..Default::default()
            }),
            Op::Access { mask } if mask as i32 & libc::W_OK != 0 => reply.error(libc::EROFS),
            Op::Access { .. } | Op::Flush { .. } | Op::Release(_) | Op::Releasedir(_) => reply.ok(),
            Op::Fsync { .. } | Op::Fsyncdir { .. } | Op::Syncfs => reply.ok(),
            Op::Readlink => reply.error(libc::EINVAL),
            Op::Other(_) | Op::Getlk(_) | Op::Setlk { .. } | Op::Lseek(_) => reply.error(libc::ENOSYS),
            _ => reply.error(libc::EROFS),
        }
    }

    fn forget(&self, nodeid: u64, nlookup: u64) {
        if nodeid >= LAYER_SPAN {
            if let Some(l) = self.layer((nodeid / LAYER_SPAN - 1) as usize) {
                l.fs.forget(nodeid, nlookup);
            }
        }
    }

    fn destroy(&self) {
        for l in self.layers.read().unwrap().iter() {
            l.fs.destroy();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_read_from_their_encoding_with_slashes() {
        let r = "127.0.0.1:5000/app:v1";
        let enc = base64::engine::general_purpose::STANDARD.encode(r);
        assert_eq!(LayerStoreFs::reference(&enc).as_deref(), Some(r));
        // An encoding with '/' in it, as a path of directories.
        let r = "???.example:5000/app:v1";
        let enc = base64::engine::general_purpose::STANDARD.encode(r);
        assert!(enc.contains('/'), "{enc}");
        assert_eq!(LayerStoreFs::reference(&enc).as_deref(), Some(r));
        assert_eq!(LayerStoreFs::reference("!!"), None);
        assert!(LayerStoreFs::is_digest(&format!("sha256:{}", "a".repeat(64))));
        assert!(!LayerStoreFs::is_digest(&format!("sha256:{}", "A".repeat(64))));
        assert!(!LayerStoreFs::is_digest("sha256:abc"));
    }
}
