//! `tilefs pull --containerd`: an image made in containerd through its
//! API, so that `ctr` and `nerdctl` run it on the tilefs snapshotter as
//! CRI would, lazily where the snapshotter can serve it so.
//!
//! The image is opened and judged by the signature policy here (it is
//! tilefs that pulls). Its manifest (and the index its reference names)
//! and configuration go into containerd's content store, with the labels
//! containerd's gc follows (manifest to configuration and layers,
//! configuration to the top snapshot). Each layer is then prepared
//! through containerd's snapshots service with the labels CRI gives
//! (`containerd.io/snapshot.ref` and `cri.*`), which the snapshotter's
//! lazy path answers with AlreadyExists and a committed lazy snapshot
//! ([`crate::lazy`]). A layer it does not serve lazily gets an ordinary
//! active snapshot: its blob is written into the content store
//! (containerd checks it against its digest), containerd's differ applies
//! it (its own rules for whiteouts and hostile entries, as for `ctr
//! pull`), the diff ID it reports is checked against the configuration's,
//! and the snapshot is committed. The image record comes last, so an
//! image `ctr images ls` lists is runnable. Everything is held by a lease
//! until then, so containerd's gc does not collect a half-made image.

use crate::lazy::{self, LABEL_IMAGE_REF, LABEL_LAYER, LABEL_MANIFEST, LABEL_TARGET};
use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::diff_client::DiffClient;
use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::services::v1::introspection_client::IntrospectionClient;
use containerd_client::services::v1::leases_client::LeasesClient;
use containerd_client::services::v1::snapshots::snapshots_client::SnapshotsClient;
use containerd_client::services::v1::snapshots::{
    CommitSnapshotRequest, PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
};
use containerd_client::services::v1::{
    AbortRequest, ApplyRequest, CreateImageRequest, CreateRequest, DeleteRequest, Image, InfoRequest, PluginsRequest,
    UpdateImageRequest, UpdateRequest, WriteAction, WriteContentRequest,
};
use containerd_client::types::{Descriptor, Mount};
use serde_json::Value;
use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, SystemTime};
use tilefs_oci::digest::Digest;
use tilefs_oci::lazy_index::LazyKind;
use tilefs_oci::manifest::BlobRef;
use tilefs_oci::{ImageRef, OciError, PullOptions};
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Request, Status};

/// How to pull into containerd.
pub struct Options {
    /// containerd's socket (its `[grpc] address`).
    pub address: PathBuf,
    pub namespace: String,
    /// The snapshotter's name in containerd (its proxy plugin's).
    pub snapshotter: String,
    /// How the registry is reached and the image judged (its `progress`
    /// is updated, its `cancel` obeyed between steps and blob chunks).
    pub pull: PullOptions,
}

/// What a pull into containerd did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The image's name in containerd (`ctr images ls`).
    pub name: String,
    /// The digest of what the reference names (the image's target).
    pub digest: String,
    pub manifest_digest: String,
    pub namespace: String,
    pub snapshotter: String,
    pub layers: usize,
    /// Layers the snapshotter made lazily (nothing of them fetched).
    pub lazy_layers: usize,
    /// Layers fetched whole into the content store and unpacked.
    pub unpacked_layers: usize,
    /// Layers containerd had already.
    pub present_layers: usize,
    /// Layer blob bytes fetched.
    pub blob_bytes: u64,
    /// How the image can start lazily, or why not.
    pub lazy: String,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Oci(#[from] OciError),
    #[error("{0}")]
    Containerd(String),
}

type Result<T> = std::result::Result<T, Error>;

const LEASE_HEADER: &str = "containerd-lease";
const NAMESPACE_HEADER: &str = "containerd-namespace";
/// A write of a blob into the content store is sent in pieces of this.
const CHUNK: usize = 1 << 20;

/// Pulls `r` into containerd (see the module's documentation).
pub fn pull(r: &ImageRef, o: &Options) -> Result<Report> {
    let (ImageRef::Registry { .. } | ImageRef::Name { .. }) = r else {
        return Err(Error::Containerd(format!(
            "{r}: --containerd pulls an image from a registry (the snapshotter fetches its files from there)"
        )));
    };
    let stage = |s: String, network: bool| {
        if let Some(p) = &o.pull.progress {
            p.stage.set(s, network);
        }
    };
    // containerd first: its mistakes are found before the registry is asked.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| Error::Containerd(format!("cannot start a runtime: {e}")))?;
    let c = rt.block_on(Ctr::connect(o))?;
    rt.block_on(c.check_snapshotter())?;
    stage(format!("resolving {r}"), true);
    let (opened, raw_config) = tilefs_oci::pull::open_with_config(r, &o.pull)?;
    let resolved = &opened.resolved;
    let what = opened.source.to_string();
    if resolved.artifact
        && resolved
            .config
            .as_ref()
            .is_some_and(|c| c.media_type == tilefs_oci::artifact::CONFIG_TYPE)
    {
        return Err(OciError::manifest(
            &what,
            "is a tilefs image that is not runnable: containerd cannot run it (`tilefs push --runnable-from` makes one)",
        )
        .into());
    }
    // The name the policy judged (a mirror may have served it).
    let logical = resolved
        .trust
        .as_ref()
        .map(|t| t.logical.trim_start_matches("docker://").to_string())
        .ok_or_else(|| OciError::manifest(&what, "was not judged by the signature policy"))?;
    let name = lazy::normalized(&logical);
    let manifest_digest = resolved
        .manifest_digest
        .clone()
        .ok_or_else(|| OciError::manifest(&what, "has no manifest digest"))?;
    let top_digest = Digest::sha256_of(&resolved.top_manifest);
    let config_ref = resolved.config.clone().expect("checked by open_with_config");
    let diff_ids = tilefs_oci::lazy_index::diff_ids(
        &raw_config,
        resolved.layers.len(),
        &format!("configuration {}", config_ref.digest),
    )?;
    let chain = lazy::chain_ids(&diff_ids);
    stage(format!("looking for a lazy path for {r}"), true);
    let lazy_how = match tilefs_oci::lazy_index::plan_opened(&opened, &raw_config, &o.pull) {
        Ok(plan) => match &plan.kind {
            LazyKind::Artifact(_) => format!("lazy: {what} is a runnable tilefs image"),
            LazyKind::Indexed(i) => format!("lazy: through tilefs index {}", i.index.manifest_digest),
            LazyKind::Toc(t) => format!("lazy: through its {} tables of contents", t.tables.formats()),
            LazyKind::Whole(why) => format!("pulled whole: {why}"),
        },
        Err(OciError::Interrupted) => return Err(OciError::Interrupted.into()),
        Err(e) => format!("pulled whole: {e}"),
    };
    let cancelled = || o.pull.cancel.as_ref().is_some_and(|c| c.load(Relaxed));

    let lease = rt.block_on(c.lease())?;
    let c = Ctr {
        lease: Some(lease.clone()),
        ..c
    };
    let result = (|| -> Result<Report> {
        let host = host_and_repo(&logical);
        let source = |l: &mut HashMap<String, String>| {
            if let Some((h, repo)) = &host {
                l.insert(format!("containerd.io/distribution.source.{h}"), repo.clone());
            }
        };
        // The configuration holds the top snapshot; the manifest the
        // configuration and layers; an index the manifest.
        let top_chain = chain.last().cloned().unwrap_or_default();
        let mut labels = HashMap::from([(format!("containerd.io/gc.ref.snapshot.{}", o.snapshotter), top_chain)]);
        source(&mut labels);
        stage("writing the manifest and configuration into containerd".into(), false);
        rt.block_on(c.put_small(&config_ref.digest, &raw_config, labels))?;
        let mut labels = HashMap::from([(
            "containerd.io/gc.ref.content.config".to_string(),
            config_ref.digest.to_string(),
        )]);
        for (i, l) in resolved.layers.iter().enumerate() {
            labels.insert(format!("containerd.io/gc.ref.content.l.{i}"), l.digest.to_string());
        }
        source(&mut labels);
        rt.block_on(c.put_small(&manifest_digest, &resolved.manifest, labels))?;
        if top_digest != manifest_digest {
            let mut labels = HashMap::from([(
                "containerd.io/gc.ref.content.m.0".to_string(),
                manifest_digest.to_string(),
            )]);
            source(&mut labels);
            rt.block_on(c.put_small(&top_digest, &resolved.top_manifest, labels))?;
        }

        let mut report = Report {
            name: name.clone(),
            digest: top_digest.to_string(),
            manifest_digest: manifest_digest.to_string(),
            namespace: o.namespace.clone(),
            snapshotter: o.snapshotter.clone(),
            layers: resolved.layers.len(),
            lazy_layers: 0,
            unpacked_layers: 0,
            present_layers: 0,
            blob_bytes: 0,
            lazy: lazy_how.clone(),
        };
        if let Some(p) = &o.pull.progress {
            p.layers_total.store(resolved.layers.len() as u64, Relaxed);
        }
        let n = resolved.layers.len();
        for (i, layer) in resolved.layers.iter().enumerate() {
            if cancelled() {
                return Err(OciError::Interrupted.into());
            }
            let parent = if i == 0 { String::new() } else { chain[i - 1].clone() };
            stage(format!("layer {} of {n}", i + 1), true);
            if rt.block_on(c.snapshot_exists(&chain[i]))? {
                report.present_layers += 1;
            } else {
                let key = format!("extract-tilefs-{} {}", unique(), chain[i]);
                let labels = HashMap::from([
                    (LABEL_TARGET.to_string(), chain[i].clone()),
                    (LABEL_IMAGE_REF.to_string(), logical.clone()),
                    (LABEL_MANIFEST.to_string(), manifest_digest.to_string()),
                    (LABEL_LAYER.to_string(), layer.digest.to_string()),
                ]);
                match rt.block_on(c.prepare(&key, &parent, labels))? {
                    None => report.lazy_layers += 1,
                    Some(mounts) => {
                        // Not served lazily: fetched and unpacked, as `ctr pull` does.
                        stage(format!("layer {} of {n}: fetching {}", i + 1, layer.digest), true);
                        let unpacked = (|| {
                            report.blob_bytes += c.put_blob(&rt, &opened, layer, &diff_ids[i], &source, &o.pull)?;
                            stage(format!("layer {} of {n}: unpacking", i + 1), false);
                            rt.block_on(c.apply(layer, mounts, &diff_ids[i]))?;
                            rt.block_on(c.commit(&chain[i], &key))
                        })();
                        if unpacked.is_err() {
                            let _ = rt.block_on(c.remove(&key));
                        }
                        unpacked?;
                        report.unpacked_layers += 1;
                    }
                }
            }
            if let Some(p) = &o.pull.progress {
                p.layers_done.fetch_add(1, Relaxed);
            }
        }
        if report.unpacked_layers > 0 && report.lazy.starts_with("lazy:") {
            report.lazy = format!(
                "{}; but {} of {n} layers were unpacked whole (the snapshotter's log says why)",
                report.lazy, report.unpacked_layers
            );
        }
        stage(format!("making image {name}"), false);
        let media_type = media_type_of(&resolved.top_manifest);
        rt.block_on(c.image(&name, &top_digest, media_type, resolved.top_manifest.len()))?;
        Ok(report)
    })();
    // What the image holds is referenced from it now (or, after a failure,
    // is to go).
    let _ = rt.block_on(c.end_lease(&lease));
    result
}

/// A manifest's or index's media type: its own `mediaType`, else what its
/// fields make it (OCI allows leaving it out).
fn media_type_of(doc: &[u8]) -> String {
    let v: Value = serde_json::from_slice(doc).unwrap_or(Value::Null);
    match v.get("mediaType").and_then(Value::as_str) {
        Some(t) => t.to_string(),
        None if v.get("manifests").is_some() => "application/vnd.oci.image.index.v1+json".into(),
        None => "application/vnd.oci.image.manifest.v1+json".into(),
    }
}

/// `HOST` and `REPO` of `HOST/REPO[:TAG][@DIGEST]` (for containerd's
/// distribution source label).
fn host_and_repo(logical: &str) -> Option<(String, String)> {
    let (host, rest) = logical.split_once('/')?;
    Some((host.to_string(), lazy::repository(rest).to_string()))
}

fn unique() -> String {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}-{}", std::process::id(), t.as_nanos())
}

/// containerd's gRPC API in one namespace (and lease, once made).
#[derive(Clone)]
struct Ctr {
    channel: Channel,
    address: PathBuf,
    namespace: AsciiMetadataValue,
    snapshotter: String,
    lease: Option<String>,
}

impl Ctr {
    async fn connect(o: &Options) -> Result<Ctr> {
        let namespace = o
            .namespace
            .parse()
            .ok()
            .filter(|_| valid_namespace(&o.namespace))
            .ok_or_else(|| {
                Error::Containerd(format!(
                    "{:?} is not a containerd namespace (letters, digits, '.', '_' and '-', starting with a letter or digit)",
                    o.namespace
                ))
            })?;
        let path = o.address.clone();
        // The URI is unused: the connector dials the socket.
        let channel = Endpoint::from_static("http://containerd.invalid")
            .connect_timeout(Duration::from_secs(10))
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                tokio::net::UnixStream::connect(path.clone())
            }))
            .await
            .map_err(|e| {
                Error::Containerd(format!(
                    "cannot reach containerd at {}: {} (is containerd running, and is this its [grpc] address?)",
                    o.address.display(),
                    source_of(&e)
                ))
            })?;
        Ok(Ctr {
            channel,
            address: o.address.clone(),
            namespace,
            snapshotter: o.snapshotter.clone(),
            lease: None,
        })
    }

    fn req<T>(&self, m: T) -> Request<T> {
        let mut r = Request::new(m);
        r.metadata_mut().insert(NAMESPACE_HEADER, self.namespace.clone());
        if let Some(l) = self.lease.as_deref().and_then(|l| l.parse().ok()) {
            r.metadata_mut().insert(LEASE_HEADER, l);
        }
        r
    }

    /// An error of containerd's, said with what was being done.
    fn said(&self, what: &str, s: Status) -> Error {
        Error::Containerd(format!(
            "{what}: containerd at {}: {} ({:?})",
            self.address.display(),
            s.message(),
            s.code()
        ))
    }

    /// An error of a snapshot call: one containerd could not pass on to
    /// the snapshotter is said so, with the fix.
    fn said_snap(&self, what: &str, s: Status) -> Error {
        let msg = s.message();
        if s.code() == Code::Unavailable && (msg.contains("connection error") || msg.contains("dial unix")) {
            return Error::Containerd(format!(
                "{what}: containerd cannot reach its snapshotter {:?}: {msg} (is `tilefs snapshotter` running, \
                 listening at the address of containerd's [proxy_plugins.{}]?)",
                self.snapshotter, self.snapshotter
            ));
        }
        self.said(what, s)
    }

    /// Fails, saying how to set it up, unless containerd has the
    /// snapshotter.
    async fn check_snapshotter(&self) -> Result<()> {
        let plugins = IntrospectionClient::new(self.channel.clone())
            .plugins(self.req(PluginsRequest {
                filters: vec![format!("type==io.containerd.snapshotter.v1,id=={}", self.snapshotter)],
            }))
            .await
            .map_err(|s| self.said("listing containerd's plugins", s))?
            .into_inner()
            .plugins;
        let Some(p) = plugins.first() else {
            return Err(Error::Containerd(format!(
                "containerd at {} has no snapshotter {s:?}: add the tilefs snapshotter to its config.toml as a proxy plugin \
                 ([proxy_plugins.{s}] type = \"snapshot\" address = \"/run/tilefs/snapshotter.sock\"), restart containerd, \
                 or name the plugin with --snapshotter",
                self.address.display(),
                s = self.snapshotter
            )));
        };
        match &p.init_err {
            Some(e) => Err(Error::Containerd(format!(
                "containerd's snapshotter {:?} failed to start: {}",
                self.snapshotter, e.message
            ))),
            None => Ok(()),
        }
    }

    /// A lease for the pull, expiring by itself in an hour should this
    /// process end before it ends it.
    async fn lease(&self) -> Result<String> {
        let id = format!("tilefs-pull-{}", unique());
        let expire =
            (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        LeasesClient::new(self.channel.clone())
            .create(self.req(CreateRequest {
                id: id.clone(),
                labels: HashMap::from([("containerd.io/gc.expire".to_string(), expire)]),
            }))
            .await
            .map_err(|s| self.said("making a lease", s))?;
        Ok(id)
    }

    async fn end_lease(&self, id: &str) -> Result<()> {
        LeasesClient::new(self.channel.clone())
            .delete(self.req(DeleteRequest {
                id: id.to_string(),
                sync: false,
            }))
            .await
            .map_err(|s| self.said("ending the lease", s))?;
        Ok(())
    }

    /// Adds `labels` to the blob `d` if the content store has it; false if
    /// it does not.
    async fn label_if_present(&self, d: &Digest, labels: &HashMap<String, String>) -> Result<bool> {
        let mut content = ContentClient::new(self.channel.clone());
        match content.info(self.req(InfoRequest { digest: d.to_string() })).await {
            Ok(info) => {
                let mut info = info.into_inner().info.unwrap_or_default();
                info.labels.extend(labels.clone());
                let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
                content
                    .update(self.req(UpdateRequest {
                        info: Some(info),
                        update_mask: Some(prost_types::FieldMask { paths }),
                    }))
                    .await
                    .map_err(|s| self.said(&format!("labelling blob {d}"), s))?;
                Ok(true)
            }
            Err(s) if s.code() == Code::NotFound => Ok(false),
            Err(s) => Err(self.said(&format!("looking for blob {d}"), s)),
        }
    }

    /// A small blob (a manifest, a configuration) into the content store.
    async fn put_small(&self, d: &Digest, bytes: &[u8], labels: HashMap<String, String>) -> Result<()> {
        if self.label_if_present(d, &labels).await? {
            return Ok(());
        }
        let r#ref = format!("tilefs-{}-{d}", unique());
        let one = WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: r#ref.clone(),
            total: bytes.len() as i64,
            expected: d.to_string(),
            offset: 0,
            data: bytes.to_vec(),
            labels,
        };
        self.write(r#ref, tokio_stream::iter(vec![one]), d).await
    }

    /// Sends a write's requests; the blob is committed (or was there).
    async fn write(
        &self,
        r#ref: String,
        reqs: impl tokio_stream::Stream<Item = WriteContentRequest> + Send + 'static,
        d: &Digest,
    ) -> Result<()> {
        let mut content = ContentClient::new(self.channel.clone());
        let done = async {
            let mut answers = content.write(self.req(reqs)).await?.into_inner();
            while answers.message().await?.is_some() {}
            Ok::<_, Status>(())
        }
        .await;
        match done {
            Ok(()) => Ok(()),
            Err(s) if s.code() == Code::AlreadyExists => Ok(()),
            Err(s) => {
                let _ = content.abort(self.req(AbortRequest { r#ref })).await;
                Err(self.said(&format!("writing blob {d} into containerd's content store"), s))
            }
        }
    }

    /// The layer blob into the content store, streamed from the registry
    /// (labelled with its diff ID, as containerd's unpacker labels it);
    /// the bytes fetched.
    fn put_blob(
        &self,
        rt: &tokio::runtime::Runtime,
        opened: &tilefs_oci::trust::Opened,
        layer: &BlobRef,
        diff_id: &Digest,
        source: &dyn Fn(&mut HashMap<String, String>),
        pull: &PullOptions,
    ) -> Result<u64> {
        let mut labels = HashMap::from([("containerd.io/uncompressed".to_string(), diff_id.to_string())]);
        source(&mut labels);
        if rt.block_on(self.label_if_present(&layer.digest, &labels))? {
            return Ok(0);
        }
        let r#ref = format!("tilefs-{}-{}", unique(), layer.digest);
        let (tx, rx) = tokio::sync::mpsc::channel::<WriteContentRequest>(4);
        let writing = {
            let c = self.clone();
            let (r, d) = (r#ref.clone(), layer.digest.clone());
            rt.spawn(async move { c.write(r, tokio_stream::wrappers::ReceiverStream::new(rx), &d).await })
        };
        let blob = layer.digest.to_string();
        if let Some(p) = &pull.progress {
            p.blob_total.fetch_add(layer.size.unwrap_or(0), Relaxed);
        }
        let mut from = opened.transport.open_blob(layer)?;
        let mut offset = 0u64;
        let mut buf = vec![0u8; CHUNK];
        let sent = 'sending: loop {
            if pull.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
                break Err(Error::Oci(OciError::Interrupted));
            }
            let mut n = 0;
            while n < CHUNK {
                match from.read(&mut buf[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => break 'sending Err(OciError::blob(&blob, e.to_string()).into()),
                }
            }
            let last = n < CHUNK;
            let req = WriteContentRequest {
                action: if last { WriteAction::Commit } else { WriteAction::Write } as i32,
                r#ref: r#ref.clone(),
                total: if last { (offset + n as u64) as i64 } else { 0 },
                expected: if last { blob.clone() } else { String::new() },
                offset: offset as i64,
                data: buf[..n].to_vec(),
                labels: if last { labels.clone() } else { HashMap::new() },
            };
            offset += n as u64;
            if let Some(p) = &pull.progress {
                p.blob_bytes.fetch_add(n as u64, Relaxed);
            }
            if tx.blocking_send(req).is_err() || last {
                break Ok(offset);
            }
        };
        // Without a commit the stream ends the write unfinished: it goes.
        drop(tx);
        let written = rt
            .block_on(writing)
            .map_err(|e| Error::Containerd(format!("writing blob {blob}: {e}")))?;
        if sent.is_err() {
            let _ = rt.block_on(ContentClient::new(self.channel.clone()).abort(self.req(AbortRequest { r#ref })));
        }
        let sent = sent?;
        written?;
        Ok(sent)
    }

    /// Whether containerd has the snapshot `name` in the namespace.
    async fn snapshot_exists(&self, name: &str) -> Result<bool> {
        let r = SnapshotsClient::new(self.channel.clone())
            .stat(self.req(StatSnapshotRequest {
                snapshotter: self.snapshotter.clone(),
                key: name.to_string(),
            }))
            .await;
        match r {
            Ok(_) => Ok(true),
            Err(s) if s.code() == Code::NotFound => Ok(false),
            Err(s) => Err(self.said_snap(&format!("looking for snapshot {name}"), s)),
        }
    }

    /// Prepares `key` over `parent`: None if the snapshotter (or
    /// containerd) answered that the snapshot `labels` name as their
    /// target exists (made lazily), else the mounts to unpack the layer
    /// into.
    async fn prepare(&self, key: &str, parent: &str, labels: HashMap<String, String>) -> Result<Option<Vec<Mount>>> {
        let r = SnapshotsClient::new(self.channel.clone())
            .prepare(self.req(PrepareSnapshotRequest {
                snapshotter: self.snapshotter.clone(),
                key: key.to_string(),
                parent: parent.to_string(),
                labels,
            }))
            .await;
        match r {
            Ok(m) => Ok(Some(m.into_inner().mounts)),
            Err(s) if s.code() == Code::AlreadyExists => Ok(None),
            Err(s) => Err(self.said_snap(&format!("preparing snapshot {key:?}"), s)),
        }
    }

    /// containerd's differ applies the layer (in the content store) to
    /// `mounts`; what it unpacked must be the configuration's diff ID.
    async fn apply(&self, layer: &BlobRef, mounts: Vec<Mount>, diff_id: &Digest) -> Result<()> {
        let applied = DiffClient::new(self.channel.clone())
            .apply(self.req(ApplyRequest {
                diff: Some(Descriptor {
                    media_type: layer.media_type.clone(),
                    digest: layer.digest.to_string(),
                    size: layer.size.unwrap_or(0) as i64,
                    annotations: HashMap::new(),
                }),
                mounts,
                payloads: HashMap::new(),
            }))
            .await
            .map_err(|s| self.said(&format!("unpacking layer {}", layer.digest), s))?
            .into_inner()
            .applied
            .map(|d| d.digest)
            .unwrap_or_default();
        if applied != diff_id.to_string() {
            return Err(OciError::layer(
                &layer.digest.to_string(),
                None,
                format!("unpacks to {applied}, but the configuration gives its diff ID as {diff_id}"),
            )
            .into());
        }
        Ok(())
    }

    async fn commit(&self, name: &str, key: &str) -> Result<()> {
        let r = SnapshotsClient::new(self.channel.clone())
            .commit(self.req(CommitSnapshotRequest {
                snapshotter: self.snapshotter.clone(),
                name: name.to_string(),
                key: key.to_string(),
                labels: HashMap::new(),
            }))
            .await;
        match r {
            Ok(_) => Ok(()),
            // Another pull committed the same layer meanwhile.
            Err(s) if s.code() == Code::AlreadyExists => self.remove(key).await,
            Err(s) => Err(self.said_snap(&format!("committing snapshot {name}"), s)),
        }
    }

    async fn remove(&self, key: &str) -> Result<()> {
        SnapshotsClient::new(self.channel.clone())
            .remove(self.req(RemoveSnapshotRequest {
                snapshotter: self.snapshotter.clone(),
                key: key.to_string(),
            }))
            .await
            .map_err(|s| self.said_snap(&format!("removing snapshot {key:?}"), s))?;
        Ok(())
    }

    /// The image record `name`, made or pointed at `target`.
    async fn image(&self, name: &str, target: &Digest, media_type: String, size: usize) -> Result<()> {
        let image = Image {
            name: name.to_string(),
            labels: HashMap::new(),
            target: Some(Descriptor {
                media_type,
                digest: target.to_string(),
                size: size as i64,
                annotations: HashMap::new(),
            }),
            created_at: None,
            updated_at: None,
        };
        let mut images = ImagesClient::new(self.channel.clone());
        match images
            .create(self.req(CreateImageRequest {
                image: Some(image.clone()),
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::AlreadyExists => {
                images
                    .update(self.req(UpdateImageRequest {
                        image: Some(image),
                        update_mask: Some(prost_types::FieldMask {
                            paths: vec!["target".into()],
                        }),
                    }))
                    .await
                    .map_err(|s| self.said(&format!("updating image {name}"), s))?;
                Ok(())
            }
            Err(s) => Err(self.said(&format!("making image {name}"), s)),
        }
    }
}

/// containerd's rule for namespaces (a label: letters, digits, '.', '_',
/// '-', starting with a letter or digit, at most 76 bytes).
fn valid_namespace(ns: &str) -> bool {
    ns.len() <= 76
        && ns.starts_with(|c: char| c.is_ascii_alphanumeric())
        && ns.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

/// The innermost cause of a connection error (tonic's own says only
/// "transport error").
fn source_of(e: &(dyn std::error::Error + 'static)) -> String {
    let mut last = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        last = s.to_string();
        cur = s.source();
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_follow_containerds_rule() {
        assert!(valid_namespace("default"));
        assert!(valid_namespace("k8s.io"));
        assert!(!valid_namespace("-x"));
        assert!(!valid_namespace("a/b"));
        assert!(!valid_namespace(""));
    }

    #[test]
    fn media_types_are_read_or_inferred() {
        assert_eq!(media_type_of(br#"{"mediaType":"x"}"#), "x");
        assert_eq!(
            media_type_of(br#"{"manifests":[]}"#),
            "application/vnd.oci.image.index.v1+json"
        );
        assert_eq!(
            media_type_of(br#"{"layers":[]}"#),
            "application/vnd.oci.image.manifest.v1+json"
        );
    }
}
