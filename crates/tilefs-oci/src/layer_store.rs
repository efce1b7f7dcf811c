//! The layers of podman's additional layer store (`tilefs layer-store`):
//! for a layer of an image reference, whether it can be served lazily and,
//! if so, the image of its diff, its lazy record and its containers/storage
//! record, made once and kept.
//!
//! A layer is served lazily when [`crate::lazy_index::plan`] finds a
//! `tilefs index` for the image (the layer's map places its files in its
//! blob) or tables of contents (eStargz, zstd:chunked); anything else is
//! left to podman, which pulls it as usual. Each layer's image is its diff
//! alone ([`crate::apply::Applier::apply_diff`]): podman stacks them.
//!
//! What each layer served needs across restarts is kept: its image, as an
//! image the store's [`Holder::LayerStore`] holds (a gc root), its lazy
//! record in the store, and in the state directory `layers/KEY.json`
//! ([`Kept`]): the reference, its `info`, where its blob is and how many
//! of podman's uses hold it. podman links each layer's `diff` into the
//! store's mount for as long as its image exists, so the same path must
//! answer after a restart, from what is kept, without the registry. When
//! podman releases the last use of a layer (it removed the images that
//! had it), the held image goes and `tilefs gc` may free its files.

use crate::digest::Digest;
use crate::fetch::LazyRecord;
use crate::lazy_index::{LazyKind, LazyPlan};
use crate::manifest::BlobRef;
use crate::pull::PullOptions;
use crate::transport::Transport;
use crate::{ImageRef, OciError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tilefs_store::owned::{self, Holder};
use tilefs_store::Store;

/// How long an image's plan is used for its other layers (podman looks its
/// layers up one after the other), while the credential files stay as
/// they were: a `podman login` makes the next lookup plan again.
const PLAN_FOR: Duration = Duration::from_secs(60);

/// What is kept of a layer served, in `STATE/layers/KEY.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Kept {
    pub reference: String,
    pub digest: String,
    /// The fs-verity digest of the layer's image (hex).
    pub image: String,
    /// `info`, as served.
    pub info: String,
    pub blob_size: u64,
    pub media_type: String,
    /// Where the blob is fetched from, as the lazy record says.
    pub source: String,
    pub tls_verify: bool,
    pub timeout_secs: u64,
    pub trust: Option<crate::trust::TrustRecord>,
    /// podman's uses not released yet.
    pub uses: u64,
}

/// A layer's image made from its table of contents, in
/// `STATE/tables/HASH.json` (HASH of the layer's digest and its table's):
/// another image with that layer, or a plan made again, uses it rather
/// than fetch and parse the table and make the image again.
#[derive(Serialize, Deserialize)]
struct Made {
    /// Its fs-verity digest (hex).
    image: String,
    /// The kept layer holding it.
    key: String,
}

/// A layer ready to serve.
pub struct Served {
    /// The file of its image (held in the store).
    pub image_path: PathBuf,
    pub image: [u8; 32],
    pub info: Vec<u8>,
    pub blob_size: u64,
    pub blob: Arc<BlobSource>,
    /// Where its files are fetched from, when it was made now from tables
    /// parsed already; None: [`crate::toc_lazy::open_source`] finds it
    /// from the lazy record in the store.
    pub source: Option<Arc<dyn tilefs_store::remote::ObjectSource>>,
}

/// An image's plan, or why there is none, when it was found and the state
/// of the credential files then ([`credentials_epoch`]).
type Planned = (Instant, u64, Arc<Result<LazyPlan, String>>);

/// The layer store's side of the registry.
pub struct LayerStore {
    store: Store,
    state: PathBuf,
    holder: Holder,
    opts: PullOptions,
    plans: Mutex<HashMap<String, Planned>>,
    /// Writes of kept records, one at a time.
    kept: Mutex<()>,
}

impl LayerStore {
    /// A layer store over `store`, keeping its records in `state`, reaching
    /// registries as `opts` says (as `tilefs pull` would).
    pub fn open(store: &Path, state: &Path, opts: PullOptions) -> Result<LayerStore, OciError> {
        // Made if needed, as a pull makes it.
        let store = Store::create(store)?;
        // Its records say where the user's credentials go: the user's alone.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state.join("layers"))
            .and_then(|()| std::fs::create_dir_all(state.join("tables")))
            .map_err(|e| OciError::io(state, "cannot make the layer store's state directory", e))?;
        let state = std::fs::canonicalize(state).map_err(|e| OciError::io(state, "cannot resolve", e))?;
        let holder = Holder::LayerStore { state: state.clone() };
        owned::register(&store, &holder)?;
        let ls = LayerStore {
            store,
            state,
            holder,
            opts,
            plans: Mutex::new(HashMap::new()),
            kept: Mutex::new(()),
        };
        ls.sweep()?;
        Ok(ls)
    }

    /// Lets go of the layers looked up but never used before this start
    /// (a lookup by anyone who may read the mount, a pull abandoned): no
    /// image of podman's links to them.
    fn sweep(&self) -> Result<(), OciError> {
        let dir = self.state.join("layers");
        let entries = std::fs::read_dir(&dir).map_err(|e| OciError::io(&dir, "cannot list", e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(key) = name.strip_suffix(".json") else {
                continue;
            };
            if self.read_kept(key).is_some_and(|k| k.uses == 0) {
                owned::remove_root(&self.store, &self.holder, key)?;
                let _ = std::fs::remove_file(e.path());
            }
        }
        // The images made from tables that no kept layer holds any more.
        let dir = self.state.join("tables");
        let entries = std::fs::read_dir(&dir).map_err(|e| OciError::io(&dir, "cannot list", e))?;
        for e in entries.flatten() {
            if !self.holds(&e.path()) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(())
    }

    /// The name of a layer's kept record and held image.
    fn key(reference: &str, digest: &str) -> String {
        let d = <sha2::Sha256 as sha2::Digest>::digest(format!("{reference}\0{digest}").as_bytes());
        format!("layer-{}", hex::encode(d))
    }

    fn made_path(&self, layer: &str, table: &str) -> PathBuf {
        let d = <sha2::Sha256 as sha2::Digest>::digest(format!("{layer}\0{table}").as_bytes());
        self.state.join("tables").join(format!("{}.json", hex::encode(d)))
    }

    /// The image made already of layer `layer` whose table of contents is
    /// `table`, if a kept layer still holds it: its bytes and digest.
    fn made(&self, layer: &str, table: &str) -> Option<(Vec<u8>, [u8; 32])> {
        let m: Made = serde_json::from_slice(&std::fs::read(self.made_path(layer, table)).ok()?).ok()?;
        let bytes = std::fs::read(owned::root_path(&self.store, &self.holder, &m.key)).ok()?;
        let digest = tilefs_image::verity::digest_bytes(&bytes);
        (hex::encode(digest) == m.image).then_some((bytes, digest))
    }

    /// Whether [`LayerStore::made`] may find that image (its table is not
    /// fetched then).
    fn is_made(&self, layer: &str, table: &str) -> bool {
        self.holds(&self.made_path(layer, table))
    }

    /// Whether the image a [`Made`] at `path` names is held still.
    fn holds(&self, path: &Path) -> bool {
        std::fs::read(path)
            .ok()
            .and_then(|raw| serde_json::from_slice::<Made>(&raw).ok())
            .is_some_and(|m| owned::root_path(&self.store, &self.holder, &m.key).is_file())
    }

    fn kept_path(&self, key: &str) -> PathBuf {
        self.state.join("layers").join(format!("{key}.json"))
    }

    fn read_kept(&self, key: &str) -> Option<Kept> {
        let raw = std::fs::read(self.kept_path(key)).ok()?;
        serde_json::from_slice(&raw).ok()
    }

    fn write_kept(&self, key: &str, k: &Kept) -> Result<(), OciError> {
        let path = self.kept_path(key);
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(k).expect("a record serializes");
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| OciError::io(&path, "cannot write", e))
    }

    /// Layer `digest` of `reference`: from what is kept, or made now if the
    /// image can be served lazily; None if it cannot.
    pub fn layer(&self, reference: &str, digest: &str) -> Result<Option<Served>, OciError> {
        let key = Self::key(reference, digest);
        if let Some(k) = self.read_kept(&key) {
            let path = owned::root_path(&self.store, &self.holder, &key);
            if let Some(image) = hex::decode(&k.image).ok().and_then(|v| <[u8; 32]>::try_from(v).ok()) {
                if path.is_file() {
                    return Ok(Some(self.served(path, image, &k)?));
                }
            }
        }
        let mut plan = self.plan(reference)?;
        // A table not fetched for an image made already that is gone
        // since (its layers released): planned again, fetching it.
        let mut made = None;
        if let Ok(LazyPlan {
            kind: LazyKind::Toc(t), ..
        }) = plan.as_ref()
        {
            if let Some(i) = t.resolved.layers.iter().position(|l| l.digest.to_string() == digest) {
                let table = t.tables.table_digest(i).unwrap_or_default();
                made = self.made(digest, table);
                if made.is_none() && !t.tables.is_read(i) {
                    let _ = std::fs::remove_file(self.made_path(digest, table));
                    self.plans.lock().unwrap().remove(reference);
                    plan = self.plan(reference)?;
                }
            }
        }
        let plan = match plan.as_ref() {
            Ok(p) => p,
            Err(e) => return Err(OciError::Reference(e.clone())),
        };
        let (resolved, diff_ids) = match &plan.kind {
            LazyKind::Indexed(img) => (&img.resolved, &img.diff_ids),
            LazyKind::Toc(t) => (&t.resolved, &t.diff_ids),
            LazyKind::Artifact(_) | LazyKind::Whole(_) => return Ok(None),
        };
        let Some(i) = resolved.layers.iter().position(|l| l.digest.to_string() == digest) else {
            return Ok(None);
        };
        let layer = &resolved.layers[i];
        let mut one = resolved.clone();
        one.layers = vec![layer.clone()];
        // Held shared until the image is held: a gc meanwhile would take
        // the objects found present for unreferenced.
        let lock = self.store.lock(tilefs_store::LockMode::Shared, true)?;
        let mut source = None;
        let mut made_now = None;
        let (image, diff_size, src) = match &plan.kind {
            LazyKind::Indexed(img) => {
                let (image, src) = self.indexed_diff(img, i, &one)?;
                let image = (image.bytes, image.digest);
                let size = img.index.maps[i].seek.as_ref().map(|s| s.uncompressed_size());
                (image, size, src)
            }
            LazyKind::Toc(t) => {
                // Made for another image with this layer, its record in
                // the store (where its files are fetched from: that
                // image's repository) if it lacks files still.
                let image = match made {
                    Some(image) => image,
                    None => {
                        let made = t
                            .tables
                            .diff_image(&self.store, i)
                            .map_err(|e| OciError::manifest(format!("{reference} layer {digest}"), e))?;
                        match made.record {
                            Some(r) => {
                                r.save(&self.store, &made.digest)?;
                                source = Some(t.tables.diff_source(&self.store, i, r)?);
                            }
                            None => tilefs_store::remote::forget(&self.store, &made.digest)?,
                        }
                        made_now = t.tables.table_digest(i).map(|d| self.made_path(digest, d));
                        (made.image, made.digest)
                    }
                };
                let src = (
                    t.source.to_string(),
                    t.opts.registry.tls_verify,
                    t.opts.registry.timeout.as_secs(),
                );
                // (The table of contents does not say the tar stream's
                // length: podman shows the blob's.)
                (image, None, src)
            }
            LazyKind::Artifact(_) | LazyKind::Whole(_) => unreachable!("returned above"),
        };
        let (bytes, image) = image;
        crate::trust::save_evidence(&self.store, &image, &one)?;
        let path = owned::write_root(&self.store, &self.holder, &key, &bytes)?;
        drop(lock);
        let size = layer.size.unwrap_or(0);
        let info = serde_json::json!({
            "id": "",
            "compressed-diff-digest": layer.digest.to_string(),
            "compressed-size": size,
            "diff-digest": diff_ids[i].to_string(),
            "diff-size": diff_size.unwrap_or(size),
            "compression": compression(&layer.media_type),
        });
        let _w = self.kept.lock().unwrap();
        let kept = Kept {
            reference: reference.to_string(),
            digest: digest.to_string(),
            image: hex::encode(image),
            info: info.to_string(),
            blob_size: size,
            media_type: layer.media_type.clone(),
            source: src.0,
            tls_verify: src.1,
            timeout_secs: src.2,
            trust: resolved.trust.clone(),
            uses: self.read_kept(&key).map_or(0, |k| k.uses),
        };
        self.write_kept(&key, &kept)?;
        if let Some(path) = made_now {
            let m = Made {
                image: kept.image.clone(),
                key: key.clone(),
            };
            let tmp = path.with_extension(format!("{key}.tmp"));
            std::fs::write(&tmp, serde_json::to_vec(&m).expect("a record serializes"))
                .and_then(|()| std::fs::rename(&tmp, &path))
                .map_err(|e| OciError::io(&path, "cannot write", e))?;
        }
        let mut served = self.served(path, image, &kept)?;
        served.source = source;
        Ok(Some(served))
    }

    /// The image of layer `i`'s diff of an indexed image (its lazy record
    /// written, `one` being the image resolved to that layer alone), and
    /// where its blob is fetched from (reference, TLS, timeout).
    fn indexed_diff(
        &self,
        img: &crate::lazy_index::IndexedImage,
        i: usize,
        one: &crate::transport::Resolved,
    ) -> Result<(tilefs_image::erofs::Image, (String, bool, u64)), OciError> {
        let map = &img.index.maps[i];
        let digest = one.layers[0].digest.to_string();
        let what = || format!("{} layer {digest}", img.source);
        let mut applier = crate::apply::Applier::new(true);
        applier.apply_diff(&digest, map.entries.clone())?;
        let tree = applier.finish();
        let image = tilefs_image::erofs::write_image(
            &tree,
            &tilefs_image::erofs::WriteOptions {
                min_version: crate::compat::FORMAT_VERSION,
                max_version: crate::compat::FORMAT_VERSION,
            },
        )
        .map_err(|e| OciError::manifest(what(), format!("cannot write its image: {e}")))?;
        let objects = crate::artifact::objects_of(&tree);
        let index = crate::lazy_index::locate(&[map.as_ref()], &objects).map_err(|e| OciError::manifest(what(), e))?;
        let record = LazyRecord::for_layers(
            &img.source,
            one,
            &img.opts,
            &[map.as_ref()],
            index,
            img.index.trust.clone(),
        );
        match tilefs_store::presence::absent(&self.store, objects.iter().map(|o| o.digest)).len() {
            0 => tilefs_store::remote::forget(&self.store, &image.digest)?,
            _ => record.save(&self.store, &image.digest)?,
        }
        let src = (record.source.clone(), record.tls_verify, record.timeout_secs);
        Ok((image, src))
    }

    fn served(&self, path: PathBuf, image: [u8; 32], k: &Kept) -> Result<Served, OciError> {
        let digest = Digest::parse(&k.digest).map_err(|e| OciError::Reference(format!("{}: {e}", k.digest)))?;
        Ok(Served {
            image_path: path,
            image,
            info: k.info.clone().into_bytes(),
            blob_size: k.blob_size,
            blob: Arc::new(BlobSource {
                blob: BlobRef {
                    digest,
                    size: Some(k.blob_size),
                    media_type: k.media_type.clone(),
                    member: None,
                },
                kept: k.clone(),
                transport: OnceLock::new(),
            }),
            source: None,
        })
    }

    /// `reference`'s plan, found once a minute at most, or again when a
    /// credential file changed.
    fn plan(&self, reference: &str) -> Result<Arc<Result<LazyPlan, String>>, OciError> {
        let creds = credentials_epoch();
        if let Some((t, c, p)) = self.plans.lock().unwrap().get(reference) {
            if t.elapsed() < PLAN_FOR && *c == creds {
                return Ok(p.clone());
            }
        }
        let r = ImageRef::parse(&format!("docker://{reference}"))
            .or_else(|_| ImageRef::parse(reference))
            .map_err(|e| OciError::Reference(format!("{reference}: {e}")))?;
        let p = Arc::new(
            crate::lazy_index::plan_for(
                &r,
                &self.opts,
                crate::lazy_index::Needs {
                    maps_only: true,
                    known_table: &|layer, table| self.is_made(layer, table),
                },
            )
            .map_err(|e| e.to_string()),
        );
        self.plans
            .lock()
            .unwrap()
            .insert(reference.to_string(), (Instant::now(), creds, p.clone()));
        Ok(p)
    }

    /// podman started (`up`) or stopped using a layer. The last release
    /// lets its held image go: true then (or if it was not kept).
    pub fn note_use(&self, reference: &str, digest: &str, up: bool) -> Result<bool, OciError> {
        let key = Self::key(reference, digest);
        let _w = self.kept.lock().unwrap();
        let Some(mut k) = self.read_kept(&key) else {
            return Ok(true);
        };
        k.uses = if up { k.uses + 1 } else { k.uses.saturating_sub(1) };
        if k.uses == 0 {
            owned::remove_root(&self.store, &self.holder, &key)?;
            let path = self.kept_path(&key);
            std::fs::remove_file(&path).map_err(|e| OciError::io(&path, "cannot remove", e))?;
            return Ok(true);
        }
        self.write_kept(&key, &k).map(|()| false)
    }
}

/// A number that changes when a credential file does (a `podman login`,
/// a `logout`): what the layer store's refusals are remembered with.
pub fn credentials_epoch() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    crate::transport::auth::files_state().hash(&mut h);
    h.finish()
}

/// containers/storage's compression of a layer media type (its
/// `archive.Compression`: 0 none, 2 gzip, 4 zstd).
fn compression(media_type: &str) -> u32 {
    if media_type.ends_with("gzip") {
        2
    } else if media_type.ends_with("zstd") {
        4
    } else {
        0
    }
}

/// A layer blob, read by range from its registry (under the signature
/// policy, checked again before the first read).
pub struct BlobSource {
    blob: BlobRef,
    kept: Kept,
    transport: OnceLock<Result<Box<dyn Transport>, String>>,
}

impl BlobSource {
    /// Up to `len` bytes at `offset`.
    pub fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, String> {
        let t = self.transport.get_or_init(|| {
            crate::fetch::open_transport(
                &self.kept.source,
                self.kept.tls_verify,
                Duration::from_secs(self.kept.timeout_secs),
                self.kept.trust.as_ref(),
                None,
            )
        });
        let t = t.as_ref().map_err(Clone::clone)?;
        let mut out = Vec::with_capacity(len);
        t.open_range(&self.blob, offset, len as u64)
            .map_err(|e| e.to_string())?
            .take(len as u64)
            .read_to_end(&mut out)
            .map_err(|e| format!("blob {}: {e}", self.blob.digest))?;
        Ok(out)
    }
}
