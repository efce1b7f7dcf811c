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
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use std::io::{self, Read};
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
        let parsed: Reference = reference
            .parse()
            .map_err(|e| OciError::Reference(format!("invalid registry reference {reference:?}: {e}")))?;
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
        let client = rt.block_on(async { Client::new(config) });
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
        let mut msg = with_causes(&e);
        if self.tls_verify && msg.contains("InvalidContentType") {
            msg.push_str(" (it does not speak TLS: a plain-HTTP registry needs --tls-verify=false)");
        }
        if matches!(
            e,
            oci_client::errors::OciDistributionError::UnauthorizedError { .. }
                | oci_client::errors::OciDistributionError::AuthenticationFailure(_)
        ) {
            msg.push_str(&format!(" ({})", self.auth_source));
        }
        self.error(what, msg)
    }

    fn manifest(&self, r: &Reference) -> Result<Vec<u8>, OciError> {
        let fut = self.client.pull_manifest_raw(r, &self.auth, MANIFEST_TYPES);
        let (bytes, _) = self
            .rt
            .block_on(async { tokio::time::timeout(self.timeout * 2, fut).await })
            .map_err(|_| self.error(&format!("manifest of {r}"), "timed out"))?
            .map_err(|e| self.client_error(&format!("manifest of {r}"), e))?;
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
            let err = |e: String| io::Error::other(format!("registry {registry}: blob {what}: {e}"));
            let mut stream = match client.pull_blob_stream(&reference, &desc).await {
                Ok(s) => s.stream,
                Err(e) => {
                    let _ = tx.send(Err(err(with_causes(&e)))).await;
                    return;
                }
            };
            while let Some(chunk) = stream.next().await {
                let item = chunk.map_err(|e| err(with_causes(&e)));
                let failed = item.is_err();
                // The reader went away (an error elsewhere): stop.
                if tx.send(item).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Box::new(ChannelReader {
            rx,
            current: bytes::Bytes::new(),
            done: false,
            expected: blob.size,
            received: 0,
        }))
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
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.done {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
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
