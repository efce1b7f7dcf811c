//! Registries, through the OCI distribution API (oci-client): token and
//! basic authentication with the credentials [`super::auth`] finds,
//! manifests in OCI and Docker media types, blobs streamed.
//!
//! The client is asynchronous; a small runtime of our own drives it, and
//! each blob reaches the (synchronous, multi-threaded) layer readers
//! through a bounded channel, so a slow reader slows the download rather
//! than buffering the blob in memory.

use super::{resolve_manifest, RegistryOptions, Resolved, Transport};
use crate::digest::Digest;
use crate::manifest::{BlobRef, Platform, MANIFEST_TYPES, MAX_MANIFEST};
use crate::OciError;
use futures_util::StreamExt;
use oci_client::client::{BlobResponse, ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use std::io::{self, Read};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tokio::sync::mpsc;

pub struct Registry {
    rt: tokio::runtime::Runtime,
    client: Client,
    reference: Reference,
    auth: RegistryAuth,
    registry: String,
    timeout: std::time::Duration,
    tls_verify: bool,
    /// Said when the registry refuses us: which credentials were used.
    auth_source: String,
}

impl Registry {
    pub fn open(reference: &str, opts: &RegistryOptions) -> Result<Registry, OciError> {
        let parsed: Reference = reference.parse::<Reference>().map_err(|e| {
            // The client says only "invalid reference format".
            let why = match tilefs_trust::DockerRef::parse_normalized(reference) {
                Err(re) => re.why,
                Ok(_) if reference.chars().any(|c| c.is_ascii_uppercase()) => {
                    "repository names are lower case".to_string()
                }
                Ok(_) => e.to_string(),
            };
            OciError::Reference(format!("invalid registry reference {reference:?}: {why}"))
        })?;
        let registry = parsed.resolve_registry().to_string();
        let creds = super::auth::credentials(&registry)?;
        let auth_source = match &creds {
            Some(c) => format!("the credentials in {} were refused", c.file.display()),
            None => format!(
                "no credentials for {registry} in {}",
                super::auth::auth_files()
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let auth = match creds {
            Some(c) => RegistryAuth::Basic(c.user, c.password),
            None => RegistryAuth::Anonymous,
        };
        let config = ClientConfig {
            protocol: if opts.tls_verify {
                ClientProtocol::Https
            } else {
                ClientProtocol::Http
            },
            accept_invalid_certificates: !opts.tls_verify,
            read_timeout: Some(opts.timeout),
            connect_timeout: Some(opts.timeout),
            // Blobs are pushed whole in one request: their size is known.
            use_monolithic_push: true,
            ..ClientConfig::default()
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("tilefs-registry")
            .build()
            .map_err(|e| OciError::Registry {
                registry: registry.clone(),
                reason: format!("cannot start the client's threads: {e}"),
            })?;
        // TLS needs a crypto provider chosen once per process.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = rt.block_on(async {
            let c = Client::new(config);
            c.store_auth_if_needed(&registry, &auth).await;
            c
        });
        Ok(Registry {
            rt,
            client,
            reference: parsed,
            auth,
            registry,
            timeout: opts.timeout,
            tls_verify: opts.tls_verify,
            auth_source,
        })
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> OciError {
        OciError::Registry {
            registry: self.registry.clone(),
            reason: format!("{what}: {e}"),
        }
    }

    fn client_error(&self, what: &str, e: oci_client::errors::OciDistributionError) -> OciError {
        let mut msg = match &e {
            // What the registry said, not the client's dump of it (its URL
            // and "envelope").
            oci_client::errors::OciDistributionError::RegistryError { envelope, .. } if !envelope.errors.is_empty() => {
                format!("the registry answered {}", said(envelope))
            }
            e => with_causes(e),
        };
        if self.tls_verify && msg.contains("InvalidContentType") {
            msg.push_str(" (it does not speak TLS: a plain-HTTP registry needs --tls-verify=false)");
        }
        // (A HEAD request's refusal comes as a bare status.)
        if matches!(
            e,
            oci_client::errors::OciDistributionError::UnauthorizedError { .. }
                | oci_client::errors::OciDistributionError::AuthenticationFailure(_)
        ) || msg.contains("401 Unauthorized")
            || msg.contains("403 Forbidden")
            || msg.contains("answered UNAUTHORIZED")
            || msg.contains("answered DENIED")
        {
            msg.push_str(&format!(" ({})", self.auth_source));
        }
        self.error(what, msg)
    }

    /// `what` got no answer within the timeout.
    fn timed_out(&self, what: &str) -> OciError {
        self.error(
            what,
            format!(
                "no answer within {} s (--timeout; is {} the registry, and up?)",
                self.timeout.as_secs(),
                self.registry
            ),
        )
    }

    /// What the registry lacks, said as such: the repository, or the tag
    /// (with the tags it has), or the manifest of that digest.
    fn missing(&self, r: &Reference, e: &oci_client::errors::OciDistributionError) -> OciError {
        use oci_client::errors::{OciDistributionError as E, OciErrorCode};
        let repo = r.repository();
        let name_unknown = |e: &E| match e {
            E::RegistryError { envelope, .. } => envelope.errors.iter().any(|x| x.code == OciErrorCode::NameUnknown),
            E::ServerError { code, .. } => *code == 404,
            _ => false,
        };
        // The registry's tags of the repository say whether there is one
        // (many registries answer MANIFEST_UNKNOWN either way).
        let tags = if matches!(e, E::RegistryError { .. }) && name_unknown(e) {
            Err(true)
        } else {
            let fut = self.client.list_tags(r, &self.auth, Some(50), None);
            match self
                .rt
                .block_on(async { tokio::time::timeout(self.timeout, fut).await })
            {
                Ok(Ok(list)) => Ok(list.tags),
                Ok(Err(e)) => Err(name_unknown(&e)),
                Err(_) => Err(false),
            }
        };
        let reason = match (tags, r.digest()) {
            (Err(true), _) => format!("no repository {repo} (check its name)"),
            (_, Some(d)) => format!("no manifest {d} in repository {repo}"),
            (tags, None) => {
                let tag = r.tag().unwrap_or("latest");
                let known = match tags {
                    Ok(list) if list.is_empty() => " (it has no tags)".to_string(),
                    Ok(list) => format!(
                        " (its tags: {}{})",
                        list.join(", "),
                        if list.len() >= 50 { ", …" } else { "" }
                    ),
                    Err(_) => String::new(),
                };
                format!("no tag {tag:?} in repository {repo}{known}")
            }
        };
        OciError::Registry {
            registry: self.registry.clone(),
            reason,
        }
    }

    fn manifest(&self, r: &Reference) -> Result<Vec<u8>, OciError> {
        let fut = self.client.pull_manifest_raw(r, &self.auth, MANIFEST_TYPES);
        let (bytes, _) = self
            .rt
            .block_on(async { tokio::time::timeout(self.timeout, fut).await })
            .map_err(|_| self.timed_out(&format!("manifest of {r}")))?
            .map_err(|e| match e {
                e if not_found(&e) => self.missing(r, &e),
                // Bytes that are not what their digest says: not a registry
                // to pass over for the next one, an error.
                oci_client::errors::OciDistributionError::DigestError(d) => OciError::blob(
                    r.digest().unwrap_or("manifest"),
                    format!("manifest from {} does not match its digest: {d}", self.registry),
                ),
                e => self.client_error(&format!("manifest of {r}"), e),
            })?;
        if bytes.len() as u64 > MAX_MANIFEST {
            return Err(self.error(&format!("manifest of {r}"), "larger than 4 MiB"));
        }
        Ok(bytes.to_vec())
    }
}

impl Transport for Registry {
    fn resolve(&self, platform: &Platform) -> Result<Resolved, OciError> {
        let top = self.manifest(&self.reference)?;
        // A manifest asked for by digest must have it.
        let top_digest = match self.reference.digest() {
            Some(want) => {
                let want = Digest::parse(want).map_err(OciError::Reference)?;
                if !want.matches(&top) {
                    return Err(OciError::blob(
                        &want.to_string(),
                        format!("manifest from {} does not match its digest", self.registry),
                    ));
                }
                want
            }
            None => Digest::sha256_of(&top),
        };
        resolve_manifest(
            top,
            Some(top_digest),
            &format!("manifest of {}", self.reference),
            platform,
            &|d, _| {
                let r = self.reference.clone_with_digest(d.to_string());
                let bytes = self.manifest(&r)?;
                if !d.matches(&bytes) {
                    return Err(OciError::blob(
                        &d.to_string(),
                        format!("manifest from {} does not match its digest", self.registry),
                    ));
                }
                Ok(bytes)
            },
        )
    }

    fn open_blob(&self, blob: &BlobRef) -> Result<Box<dyn Read + Send + '_>, OciError> {
        Ok(Box::new(self.stream(blob, None)))
    }

    fn open_range(&self, blob: &BlobRef, offset: u64, len: u64) -> Result<Box<dyn Read + Send + '_>, OciError> {
        Ok(Box::new(self.stream(blob, Some((offset, len)))))
    }

    fn origin(&self) -> String {
        format!("registry {}", self.registry)
    }
}

impl Registry {
    /// Streams a blob, or `len` bytes of it from `offset`, through a
    /// bounded channel. A registry that ignores the range and sends the
    /// whole blob is read past the bytes before the range.
    fn stream(&self, blob: &BlobRef, range: Option<(u64, u64)>) -> ChannelReader {
        let desc = oci_client::manifest::OciDescriptor {
            media_type: blob.media_type.clone(),
            digest: blob.digest.to_string(),
            size: blob.size.unwrap_or(0) as i64,
            ..Default::default()
        };
        let (tx, rx) = mpsc::channel::<io::Result<bytes::Bytes>>(16);
        let client = self.client.clone();
        let reference = self.reference.clone();
        let registry = self.registry.clone();
        let what = blob.digest.to_string();
        self.rt.spawn(async move {
            // A part of a blob is read for a caller that names the blob
            // and the registry itself.
            let err = |e: String| match range {
                None => io::Error::other(format!("registry {registry}: blob {what}: {e}")),
                Some(_) => io::Error::other(e),
            };
            let (mut stream, mut skip, mut left) = match range {
                None => match client.pull_blob_stream(&reference, &desc).await {
                    Ok(s) => (s.stream, 0, u64::MAX),
                    Err(e) => {
                        let _ = tx.send(Err(err(with_causes(&e)))).await;
                        return;
                    }
                },
                Some((offset, len)) => match client
                    .pull_blob_stream_partial(&reference, &desc, offset, Some(len))
                    .await
                {
                    Ok(BlobResponse::Partial(s)) => (s.stream, 0, len),
                    Ok(BlobResponse::Full(s)) => (s.stream, offset, len),
                    Err(e) => {
                        let _ = tx.send(Err(err(with_causes(&e)))).await;
                        return;
                    }
                },
            };
            while let Some(chunk) = stream.next().await {
                let item = chunk.map_err(|e| err(with_causes(&e)));
                let failed = item.is_err();
                let item = item.map(|mut b| {
                    let cut = skip.min(b.len() as u64) as usize;
                    skip -= cut as u64;
                    let _ = b.split_to(cut);
                    b.truncate(left.min(b.len() as u64) as usize);
                    left -= b.len() as u64;
                    b
                });
                // The reader went away (an error elsewhere): stop.
                if tx.send(item).await.is_err() || failed || left == 0 {
                    return;
                }
            }
        });
        ChannelReader {
            rx,
            current: bytes::Bytes::new(),
            done: false,
            expected: range.map(|r| r.1).or(blob.size),
            received: 0,
            handle: self.rt.handle().clone(),
            // A stalled transfer fails rather than hangs its reader.
            stall: self.timeout,
        }
    }

    /// Whether the repository has blob `d`.
    pub fn has_blob(&self, d: &Digest) -> Result<bool, OciError> {
        let digest = d.to_string();
        let fut = self.client.blob_exists(&self.reference, &digest);
        self.run(&format!("blob {d}"), fut)
    }

    /// Asks the registry to link blob `d` from repository `from` (same
    /// registry) into ours; false when it will not.
    pub fn mount_from(&self, d: &Digest, from: &str) -> bool {
        let Ok(source) = format!("{}/{from}", self.registry).parse::<Reference>() else {
            return false;
        };
        let digest = d.to_string();
        let fut = self.client.mount_blob(&self.reference, &source, &digest);
        self.run("mount", fut).is_ok()
    }

    /// Uploads blob `d` of `size` bytes, read from `src` on a thread of
    /// its own while it is sent; `sent` counts the bytes the HTTP client
    /// has taken to send (not those merely read).
    pub fn upload(
        &self,
        d: &Digest,
        size: u64,
        src: &mut (dyn Read + Send),
        sent: &Arc<AtomicU64>,
    ) -> Result<(), OciError> {
        let (tx, rx) = mpsc::channel::<Result<bytes::Bytes, oci_client::errors::OciDistributionError>>(4);
        let digest = d.to_string();
        // This blob's bytes taken by the client (`sent` may be shared).
        let taken = Arc::new(AtomicU64::new(0));
        let (r, read) = std::thread::scope(|s| {
            let reader = s.spawn(move || -> io::Result<()> {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let n = match src.read(&mut buf) {
                        Ok(0) => return Ok(()),
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            let msg = e.to_string();
                            let _ = tx
                                .blocking_send(Err(oci_client::errors::OciDistributionError::GenericError(Some(msg))));
                            return Err(e);
                        }
                    };
                    if tx.blocking_send(Ok(bytes::Bytes::copy_from_slice(&buf[..n]))).is_err() {
                        return Ok(());
                    }
                }
            });
            let counters = (sent.clone(), taken.clone());
            let stream = futures_util::stream::unfold((rx, counters), |(mut rx, counters)| async move {
                let x = rx.recv().await?;
                let (sent, taken) = &counters;
                if let Ok(b) = &x {
                    sent.fetch_add(b.len() as u64, Relaxed);
                    taken.fetch_add(b.len() as u64, Relaxed);
                }
                Some((x, (rx, counters)))
            });
            // A registry that stops taking bytes (or answering) for the
            // timeout fails the upload: a stalled write has no timeout of
            // its own.
            let push = self
                .client
                .push_blob_stream(&self.reference, stream, &digest, Some(size));
            let stalled = async {
                let mut last = (taken.load(Relaxed), tokio::time::Instant::now());
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                    let now = taken.load(Relaxed);
                    if now != last.0 {
                        last = (now, tokio::time::Instant::now());
                    } else if last.1.elapsed() >= self.timeout {
                        return;
                    }
                }
            };
            let r = self.rt.block_on(async {
                match futures_util::future::select(Box::pin(push), Box::pin(stalled)).await {
                    futures_util::future::Either::Left((r, _)) => Some(r),
                    futures_util::future::Either::Right(_) => None,
                }
            });
            let r = match r {
                Some(r) => r,
                None => {
                    // The reader may wait on a full channel: let it go.
                    Err(oci_client::errors::OciDistributionError::GenericError(Some(format!(
                        "no progress for {} s (--timeout)",
                        self.timeout.as_secs()
                    ))))
                }
            };
            let read = reader
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the reading thread failed")));
            (r, read)
        });
        if let Err(e) = read {
            return Err(self.error(&format!("blob {d}"), format!("cannot read what to upload: {e}")));
        }
        r.map(drop)
            .map_err(|e| self.client_error(&format!("upload of blob {d}"), e))
    }

    /// Puts `manifest` under the reference's tag; returns the URL.
    pub fn put_manifest(&self, manifest: Vec<u8>) -> Result<String, OciError> {
        let fut = self.client.push_manifest_raw(
            &self.reference,
            manifest,
            crate::manifest::OCI_MANIFEST.parse().expect("a valid header value"),
        );
        self.run("manifest", fut)
    }

    /// The repository, as the registry names it.
    pub fn repository(&self) -> &str {
        self.reference.repository()
    }

    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// Runs a client call with the timeout.
    fn run<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, oci_client::errors::OciDistributionError>>,
    ) -> Result<T, OciError> {
        self.rt
            .block_on(async { tokio::time::timeout(self.timeout, fut).await })
            .map_err(|_| self.timed_out(what))?
            .map_err(|e| self.client_error(what, e))
    }
}

/// The reading end of a blob download.
struct ChannelReader {
    rx: mpsc::Receiver<io::Result<bytes::Bytes>>,
    current: bytes::Bytes,
    done: bool,
    /// The descriptor's size, and how much has come.
    expected: Option<u64>,
    received: u64,
    handle: tokio::runtime::Handle,
    /// Longest wait for the next piece.
    stall: std::time::Duration,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.done {
                return Ok(0);
            }
            let next = self
                .handle
                .block_on(async { tokio::time::timeout(self.stall, self.rx.recv()).await });
            let Ok(next) = next else {
                self.done = true;
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no data for {} s", self.stall.as_secs()),
                ));
            };
            match next {
                Some(Ok(b)) => {
                    self.received += b.len() as u64;
                    self.current = b;
                }
                Some(Err(e)) => {
                    self.done = true;
                    // Once every byte has come, the client's own digest
                    // check is all an error at the end can be: the caller
                    // checks the bytes itself and says precisely what is
                    // wrong with them.
                    if self.expected == Some(self.received) {
                        return Ok(0);
                    }
                    return Err(e);
                }
                // The sender finished: the blob is complete.
                None => self.done = true,
            }
        }
        let n = self.current.len().min(buf.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        let _ = self.current.split_to(n);
        Ok(n)
    }
}

/// A registry's errors as it gave them: `CODE: message; …`.
fn said(envelope: &oci_client::errors::OciEnvelope) -> String {
    envelope
        .errors
        .iter()
        .map(|x| {
            let code = serde_json::to_value(&x.code)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_else(|| format!("{:?}", x.code));
            if x.message.is_empty() {
                code
            } else {
                format!("{code}: {}", x.message)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// An error and its causes on one line (a client error alone often says
/// only "error sending request").
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let c_s = c.to_string();
        if !s.contains(&c_s) {
            s.push_str(": ");
            s.push_str(&c_s);
        }
        cur = c.source();
    }
    s
}

/// What signatures and their checks need from a registry.
impl Registry {
    /// The manifest tagged `tag` in this repository (any media type of
    /// [`MANIFEST_TYPES`]), or None when the registry has none.
    pub fn manifest_at(&self, tag: &str) -> Result<Option<Vec<u8>>, OciError> {
        let r = Reference::with_tag(
            self.reference.registry().to_string(),
            self.reference.repository().to_string(),
            tag.to_string(),
        );
        let fut = self.client.pull_manifest_raw(&r, &self.auth, MANIFEST_TYPES);
        match self
            .rt
            .block_on(async { tokio::time::timeout(self.timeout, fut).await })
            .map_err(|_| self.timed_out(&format!("manifest of {r}")))?
        {
            Ok((bytes, _)) if bytes.len() as u64 > MAX_MANIFEST => {
                Err(self.error(&format!("manifest of {r}"), "larger than 4 MiB"))
            }
            Ok((bytes, _)) => Ok(Some(bytes.to_vec())),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(self.client_error(&format!("manifest of {r}"), e)),
        }
    }

    /// The manifest `d` of this repository, checked against its digest.
    pub fn manifest_by_digest(&self, d: &Digest) -> Result<Vec<u8>, OciError> {
        let bytes = self.manifest(&self.reference.clone_with_digest(d.to_string()))?;
        if !d.matches(&bytes) {
            return Err(OciError::blob(
                &d.to_string(),
                format!("manifest from {} does not match its digest", self.registry),
            ));
        }
        Ok(bytes)
    }

    /// A whole small blob, checked against its digest.
    pub fn blob_bytes(&self, blob: &BlobRef, limit: u64) -> Result<Vec<u8>, OciError> {
        super::read_checked(self.stream(blob, None), &blob.digest, limit, "blob")
    }

    /// Puts `manifest` (of `media_type`) under `tag` of this repository.
    pub fn put_manifest_at(&self, tag: &str, manifest: Vec<u8>, media_type: &str) -> Result<String, OciError> {
        let r = Reference::with_tag(
            self.reference.registry().to_string(),
            self.reference.repository().to_string(),
            tag.to_string(),
        );
        let header = media_type
            .parse()
            .map_err(|_| self.error("manifest", format!("invalid media type {media_type:?}")))?;
        let fut = self.client.push_manifest_raw(&r, manifest, header);
        self.run("manifest", fut)
    }

    /// GETs `url` (a lookaside signature store) with this registry's TLS
    /// settings: the body, or None for a 404.
    pub fn http_get(&self, url: &str, limit: usize) -> Result<Option<Vec<u8>>, String> {
        let client = reqwest::Client::builder()
            .danger_accept_invalid_certs(!self.tls_verify)
            .connect_timeout(self.timeout)
            .read_timeout(self.timeout)
            .build()
            .map_err(|e| with_causes(&e))?;
        let fut = async {
            let resp = client.get(url).send().await.map_err(|e| with_causes(&e))?;
            if resp.status() == reqwest::StatusCode::NOT_FOUND {
                return Ok(None);
            }
            if !resp.status().is_success() {
                return Err(format!("{url}: HTTP status {}", resp.status()));
            }
            let mut body = Vec::new();
            let mut stream = resp.bytes_stream();
            while let Some(chunk) = stream.next().await {
                body.extend_from_slice(&chunk.map_err(|e| with_causes(&e))?);
                if body.len() > limit {
                    return Err(format!("{url}: larger than {limit} bytes"));
                }
            }
            Ok(Some(body))
        };
        self.rt
            .block_on(async { tokio::time::timeout(self.timeout, fut).await })
            .map_err(|_| format!("{url}: no answer within {} s (--timeout)", self.timeout.as_secs()))?
    }
}

/// Whether a client error says the manifest does not exist.
fn not_found(e: &oci_client::errors::OciDistributionError) -> bool {
    use oci_client::errors::OciDistributionError as E;
    match e {
        E::ImageManifestNotFoundError(_) => true,
        E::ServerError { code, .. } => *code == 404,
        E::RegistryError { envelope, .. } => envelope.errors.iter().any(|x| {
            matches!(
                x.code,
                oci_client::errors::OciErrorCode::ManifestUnknown | oci_client::errors::OciErrorCode::NameUnknown
            )
        }),
        _ => false,
    }
}
