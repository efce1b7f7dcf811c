//! Registries, through the OCI distribution API.
//!
//! Every GET (manifests, blobs and ranges of them, tag lists, lookaside
//! signatures) is made here, with reqwest, and streamed to its reader
//! through a bounded channel ([`ChannelReader`]): a slow reader slows the
//! download rather than buffering it, and a document is read with its
//! size cap ([`crate::bounded`]) as it comes. Each transfer is bounded in
//! time: `--timeout` without a byte (or for a small document's whole
//! fetch) and `--min-rate` over each `--timeout` spent waiting; and it
//! stops within a tenth of a second of a cancellation. A redirect is
//! followed only to HTTP(S).
//!
//! Credentials are those [`super::auth`] finds, sent as the registry's
//! challenge (its answer to `GET /v2/`) asks: Basic, or a Bearer token
//! asked of the token server the challenge names (with the user and
//! password, or for an identity token by OAuth2's refresh-token grant, a
//! POST, as the distribution spec's token authentication says), whose
//! answer is read
//! with its size cap ([`bounded::MAX_TOKEN_ANSWER`]) within the limits of
//! the transfer it authorizes. Uploads (a push) go through oci-client,
//! given that token (it would read a token server's answer whole).
//!
//! The client is asynchronous; a small runtime of our own drives it.

use super::keychain::Secret;
use super::{resolve_manifest, RegistryOptions, Resolved, Transport};
use crate::bounded::{self, read_at_most, MAX_ERROR_BODY, MAX_TOKEN_ANSWER};
use crate::digest::Digest;
use crate::manifest::{BlobRef, Platform, MANIFEST_TYPES, MAX_MANIFEST};
use crate::OciError;
use futures_util::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use reqwest::header::{HeaderValue, ACCEPT, AUTHORIZATION, RANGE, WWW_AUTHENTICATE};
use reqwest::StatusCode;
use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

pub struct Registry {
    rt: tokio::runtime::Runtime,
    /// oci-client: uploads.
    client: Client,
    /// The credentials oci-client uses are set (see [`Registry::client`]).
    client_auth: std::sync::OnceLock<()>,
    http: Arc<Http>,
    reference: Reference,
    registry: String,
    limits: Limits,
}

/// What bounds a transfer in time.
#[derive(Clone)]
struct Limits {
    timeout: Duration,
    min_rate: u64,
    cancel: Option<Arc<AtomicBool>>,
}

impl Limits {
    fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.load(Relaxed))
    }
}

/// What the GETs share: the HTTP client and how to authorize.
struct Http {
    client: reqwest::Client,
    /// Whose pulls (and pushes) a Bearer token is asked for.
    reference: Reference,
    /// Our credentials (None: anonymous).
    auth: Option<Secret>,
    /// `SCHEME://HOST[:PORT]`.
    base: String,
    /// Where the distribution API is: `BASE/v2`, or the path hosts.toml
    /// gives the server.
    api: String,
    /// The registry's name, as a mirror is told it (`ns`).
    name: String,
    /// Mirrors from hosts.toml ([`super::hosts`]), tried in order before
    /// the registry for blobs and manifests; and the registry's own
    /// headers from there.
    mirrors: Vec<Mirror>,
    headers: Vec<(String, String)>,
    /// The Authorization header to send, once the registry's challenge is
    /// known (the inner None: none).
    authorization: tokio::sync::Mutex<Option<Option<HeaderValue>>>,
    /// This client's entry in [`LEARNT`]: the API, the repository and
    /// a digest of the credentials.
    learnt_key: String,
    /// Said when the registry refuses us: which credentials were used.
    auth_source: String,
}

/// A mirror of the registry: asked without the registry's credentials.
struct Mirror {
    host: super::hosts::Host,
    client: reqwest::Client,
}

/// One GET.
struct Get {
    url: String,
    accept: Option<String>,
    /// (offset, length) of a part of a blob.
    range: Option<(u64, u64)>,
    /// Send the registry's credentials (not to a lookaside store).
    authorize: bool,
    /// The whole answer must come within the timeout (a small document).
    whole_within_timeout: bool,
    /// Most bytes passed on (past them the reader sees the end).
    limit: u64,
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
        let given = super::keychain::lookup(&registry, parsed.repository());
        let creds = match given {
            Some(_) => None,
            None => super::auth::credentials(&registry, parsed.repository())?,
        };
        let auth_source = match (&given, &creds) {
            (Some(_), _) => format!(
                "the credentials given for {registry}/{} (CRI's PullImage) were refused",
                parsed.repository()
            ),
            (None, Some(c)) => format!("the credentials in {} were refused", c.file.display()),
            (None, None) => format!(
                "no credentials for {registry} in {}",
                super::auth::auth_files()
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let auth = given.or(creds.map(|c| c.secret));
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
        let error = |reason: String| OciError::Registry {
            registry: registry.clone(),
            reason,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("tilefs-registry")
            .build()
            .map_err(|e| error(format!("cannot start the client's threads: {e}")))?;
        // TLS needs a crypto provider chosen once per process.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = Client::new(config);
        let scheme = if opts.tls_verify { "https" } else { "http" };
        // containerd names Docker Hub's directory docker.io.
        let name = parsed.registry().to_string();
        let hosts = super::hosts::for_registry(&name, scheme).map_err(error)?;
        let (mut mirrors, mut upstream) = (Vec::new(), None);
        for h in hosts.into_iter().flatten() {
            let client = http_client(opts, Some(&h)).map_err(|e| error(format!("hosts.toml: {}: {e}", h.origin)))?;
            match h.upstream {
                true => upstream = Some((h, client)),
                false => mirrors.push(Mirror { host: h, client }),
            }
        }
        let (base, api, headers, http) = match upstream {
            Some((h, client)) => (h.origin.clone(), format!("{}{}", h.origin, h.api), h.headers, client),
            None => (
                format!("{scheme}://{registry}"),
                format!("{scheme}://{registry}/v2"),
                Vec::new(),
                http_client(opts, None).map_err(|e| error(format!("cannot make an HTTP client: {e}")))?,
            ),
        };
        let learnt_key = format!("{api}\n{}\n{}", parsed.repository(), fingerprint(&auth));
        Ok(Registry {
            rt,
            http: Arc::new(Http {
                client: http,
                reference: parsed.clone(),
                auth,
                base,
                api,
                name,
                mirrors,
                headers,
                authorization: tokio::sync::Mutex::new(None),
                learnt_key,
                auth_source,
            }),
            client,
            client_auth: std::sync::OnceLock::new(),
            reference: parsed,
            registry,
            limits: Limits {
                timeout: opts.timeout,
                min_rate: opts.min_rate,
                cancel: opts.cancel.clone(),
            },
        })
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> OciError {
        OciError::Registry {
            registry: self.registry.clone(),
            reason: format!("{what}: {e}"),
        }
    }

    /// The error of a GET's reader: an interruption as such, the rest
    /// naming `what`.
    fn read_error(&self, what: &str, e: impl std::fmt::Display) -> OciError {
        if self.limits.cancelled() {
            return OciError::Interrupted;
        }
        self.error(what, e)
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
        if msg.contains("InvalidContentType") && self.http.base.starts_with("https:") {
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
            msg.push_str(&format!(" ({})", self.http.auth_source));
        }
        self.error(what, msg)
    }

    /// `what` got no answer within the timeout.
    fn timed_out(&self, what: &str) -> OciError {
        self.error(what, self.silent())
    }

    /// Why a server that sent nothing failed.
    fn silent(&self) -> String {
        format!(
            "no answer within {} s (--timeout; is {} the registry, and up?)",
            self.limits.timeout.as_secs(),
            self.registry
        )
    }

    fn url(&self, r: &Reference, kind: &str, name: &str) -> String {
        format!("{}/{}/{kind}/{name}", self.http.api, r.repository())
    }

    /// A small document: GET `url` (a manifest, a tag list, a lookaside
    /// signature), whole within the timeout and at most `limit` bytes.
    /// None when the server has none (404).
    fn document(
        &self,
        url: String,
        accept: Option<String>,
        authorize: bool,
        limit: u64,
        what: &str,
    ) -> Result<Option<Vec<u8>>, OciError> {
        let mut reader = self.stream(Get {
            url,
            accept,
            range: None,
            authorize,
            whole_within_timeout: true,
            limit: limit.saturating_add(1),
        });
        if !authorize {
            // Not the registry: a lookaside store.
            reader.silent = format!("no answer within {} s (--timeout)", self.limits.timeout.as_secs());
        }
        match read_at_most(&mut reader, limit) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(bounded::ReadError::Io(e)) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(bounded::ReadError::Io(e)) => Err(self.read_error(what, e)),
            Err(e) => Err(self.error(what, e)),
        }
    }

    /// The manifest `r` names (any media type of [`MANIFEST_TYPES`]), or
    /// None when the registry has none.
    fn try_manifest(&self, r: &Reference) -> Result<Option<Vec<u8>>, OciError> {
        let name = r.digest().or(r.tag()).unwrap_or("latest");
        self.document(
            self.url(r, "manifests", name),
            Some(MANIFEST_TYPES.join(", ")),
            true,
            MAX_MANIFEST,
            &format!("manifest of {r}"),
        )
    }

    fn manifest(&self, r: &Reference) -> Result<Vec<u8>, OciError> {
        match self.try_manifest(r)? {
            Some(bytes) => Ok(bytes),
            None => Err(self.missing(r)),
        }
    }

    /// What the registry lacks, said as such: the repository, or the tag
    /// (with the tags it has), or the manifest of that digest.
    fn missing(&self, r: &Reference) -> OciError {
        let repo = r.repository();
        // The registry's tags of the repository say whether there is one
        // (many registries answer MANIFEST_UNKNOWN either way).
        let list = self.document(
            format!("{}/{repo}/tags/list?n=50", self.http.api),
            None,
            true,
            MAX_ERROR_BODY,
            "tags",
        );
        let tags = match list {
            Ok(None) => Err(true),
            Ok(Some(body)) => serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("tags").cloned())
                .map(|t| match t {
                    serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect(),
                    _ => Vec::new(),
                })
                .ok_or(false),
            Err(_) => Err(false),
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
            &|d, _| self.manifest_by_digest(d),
        )
    }

    fn open_blob(&self, blob: &BlobRef) -> Result<Box<dyn Read + Send + '_>, OciError> {
        Ok(Box::new(self.blob_stream(blob, None)))
    }

    fn open_range(&self, blob: &BlobRef, offset: u64, len: u64) -> Result<Box<dyn Read + Send + '_>, OciError> {
        Ok(Box::new(self.blob_stream(blob, Some((offset, len)))))
    }

    fn origin(&self) -> String {
        format!("registry {}", self.registry)
    }
}

impl Registry {
    /// A blob, or `len` bytes of it from `offset`. Errors name the
    /// registry (a part of a blob is read for a caller that names it
    /// itself); the caller names the blob.
    fn blob_stream(&self, blob: &BlobRef, range: Option<(u64, u64)>) -> ChannelReader {
        let mut r = self.stream(Get {
            url: self.url(&self.reference, "blobs", &blob.digest.to_string()),
            accept: None,
            range,
            authorize: true,
            whole_within_timeout: false,
            // A whole blob: one byte past its size shows it is longer.
            limit: match range {
                Some((_, len)) => len,
                None => blob.size.map_or(u64::MAX, |s| s.saturating_add(1)),
            },
        });
        if range.is_none() {
            r.context = format!("registry {}: ", self.registry);
        }
        r.expected = range.map(|r| r.1).or(blob.size);
        r
    }

    /// Starts `get` and returns the reader of its answer.
    fn stream(&self, get: Get) -> ChannelReader {
        let (tx, rx) = mpsc::channel::<io::Result<bytes::Bytes>>(16);
        let http = self.http.clone();
        let (range, mut left) = (get.range, get.limit);
        let deadline = get.whole_within_timeout.then(|| Instant::now() + self.limits.timeout);
        self.rt.spawn(async move {
            let transfer = async {
                let resp = match http.send(&get).await {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                // A registry that ignores the range sends the whole blob:
                // the bytes before the range are dropped.
                let mut skip = match (range, resp.status()) {
                    (Some((offset, _)), StatusCode::OK) => offset,
                    _ => 0,
                };
                let mut stream = resp.bytes_stream();
                while let Some(chunk) = stream.next().await {
                    let item = chunk.map_err(|e| io::Error::other(with_causes(&e)));
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
            };
            // A reader that goes away ends the request, answered or not.
            let gone = tx.closed();
            futures_util::pin_mut!(transfer, gone);
            futures_util::future::select(transfer, gone).await;
        });
        ChannelReader {
            rx,
            current: bytes::Bytes::new(),
            done: false,
            expected: None,
            received: 0,
            handle: self.rt.handle().clone(),
            limits: self.limits.clone(),
            deadline,
            window: (Duration::ZERO, 0),
            silent: self.silent(),
            context: String::new(),
            failed: None,
        }
    }
}

impl Http {
    /// Sends `get`, authorized as the registry asks; a refusal of the
    /// authorization used (an expired token) is answered by asking again,
    /// once. Answers other than the data are errors: 404 of kind NotFound.
    async fn send(&self, get: &Get) -> io::Result<reqwest::Response> {
        if let Some(resp) = self.mirrored(get).await {
            return Ok(resp);
        }
        let mut renewed = false;
        loop {
            let authorization = match get.authorize {
                true => self.authorization(renewed).await?,
                false => None,
            };
            let headers = if get.authorize { &self.headers[..] } else { &[] };
            let mut req = request(&self.client, &get.url, get, headers);
            if let Some(a) = &authorization {
                req = req.header(AUTHORIZATION, a.clone());
            }
            let resp = req.send().await.map_err(|e| self.unsent(&e))?;
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED && get.authorize && !renewed {
                renewed = true;
                continue;
            }
            if answered(status, get) {
                return Ok(resp);
            }
            let location = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .map(str::to_string);
            let body = error_body(resp).await;
            let mut msg = format!("HTTP {status}{body}");
            if let (true, Some(l)) = (status.is_redirection(), location) {
                msg.push_str(&format!(
                    ": a redirect to {l:?}, not followed (only HTTP(S) redirects are)"
                ));
            }
            if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                msg.push_str(&format!(" ({})", self.auth_source));
            }
            let kind = match status {
                StatusCode::NOT_FOUND => io::ErrorKind::NotFound,
                _ => io::ErrorKind::Other,
            };
            return Err(io::Error::new(kind, msg));
        }
    }

    /// The answer of the first mirror (hosts.toml) that has what `get`
    /// asks the registry for (a blob, a manifest), if one does: a mirror
    /// that fails or lacks it is passed over for the next, the registry
    /// last.
    async fn mirrored(&self, get: &Get) -> Option<reqwest::Response> {
        let rest = get.url.strip_prefix(&self.api)?.strip_prefix('/')?;
        let by_tag = match rest.split_once("/manifests/") {
            Some((_, name)) => !name.starts_with("sha256:"),
            None if rest.contains("/blobs/") => false,
            None => return None,
        };
        for m in &self.mirrors {
            if !(if by_tag { m.host.resolve } else { m.host.pull }) {
                continue;
            }
            let req = request(&m.client, &m.host.url(rest, &self.name), get, &m.host.headers);
            if let Ok(resp) = req.send().await {
                if answered(resp.status(), get) {
                    return Some(resp);
                }
            }
        }
        None
    }

    /// Why a request could not be made, with a hint for the usual mistake.
    fn unsent(&self, e: &reqwest::Error) -> io::Error {
        let mut msg = with_causes(e);
        if self.base.starts_with("https:") && msg.contains("InvalidContentType") {
            msg.push_str(" (it does not speak TLS: a plain-HTTP registry needs --tls-verify=false)");
        }
        match e.is_timeout() {
            true => io::Error::new(io::ErrorKind::TimedOut, msg),
            false => io::Error::other(msg),
        }
    }

    /// The Authorization header the registry's challenge asks for: learnt
    /// once, again when `renew` (the one used was refused). It is shared
    /// by the clients of this process for the same repository and
    /// credentials ([`LEARNT`]), so that neither a lazy mount's fetches
    /// nor the clients a pull opens one after another (policy check,
    /// manifest, blobs) each ask `GET /v2/` first.
    async fn authorization(&self, renew: bool) -> io::Result<Option<HeaderValue>> {
        let mut known = self.authorization.lock().await;
        if let (Some(a), false) = (&*known, renew) {
            return Ok(a.clone());
        }
        let learnt = || LEARNT.lock().unwrap_or_else(|e| e.into_inner());
        let shared = match renew {
            false => learnt().as_ref().and_then(|m| m.get(&self.learnt_key).cloned()),
            true => None,
        };
        let a = match shared {
            Some(a) => a,
            None => {
                let a = self.challenge().await?;
                let mut m = learnt();
                let m = m.get_or_insert_with(Default::default);
                if m.len() >= MAX_LEARNT {
                    m.clear();
                }
                m.insert(self.learnt_key.clone(), a.clone());
                a
            }
        };
        *known = Some(a.clone());
        Ok(a)
    }

    async fn challenge(&self) -> io::Result<Option<HeaderValue>> {
        // A registry token (CRI's registry_token) is sent as it is.
        if let Some(Secret::Token(t)) = &self.auth {
            return sensitive(format!("Bearer {t}"));
        }
        let Some((scheme, challenge)) = self.asks().await? else {
            return Ok(None);
        };
        match scheme.as_str() {
            "bearer" => {
                let token = self.bearer(&challenge, RegistryOperation::Pull).await?;
                sensitive(format!("Bearer {token}"))
            }
            "basic" => match &self.auth {
                Some(Secret::Basic { user, password }) => {
                    use base64::Engine;
                    let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                    sensitive(format!("Basic {token}"))
                }
                _ => Ok(None),
            },
            _ => Ok(None),
        }
    }

    /// The credentials oci-client is to push with: a Bearer token for
    /// pulls and pushes where the registry asks for one, else ours.
    async fn push_auth(&self) -> io::Result<RegistryAuth> {
        match self.asks().await? {
            Some((scheme, challenge)) if scheme == "bearer" => Ok(RegistryAuth::Bearer(
                self.bearer(&challenge, RegistryOperation::Push).await?,
            )),
            _ => Ok(match &self.auth {
                Some(Secret::Basic { user, password }) => RegistryAuth::Basic(user.clone(), password.clone()),
                Some(Secret::Token(t)) => RegistryAuth::Bearer(t.clone()),
                // An identity token is good at a token server only.
                Some(Secret::Identity(_)) | None => RegistryAuth::Anonymous,
            }),
        }
    }

    /// What the registry asks for (its answer to `GET /v2/`): None when it
    /// asks for nothing, else the scheme (lower case) and the whole
    /// `WWW-Authenticate` challenge.
    async fn asks(&self) -> io::Result<Option<(String, String)>> {
        let resp = self
            .client
            .get(format!("{}/", self.api))
            .send()
            .await
            .map_err(|e| self.unsent(&e))?;
        if resp.status() != StatusCode::UNAUTHORIZED {
            return Ok(None);
        }
        let challenge = resp
            .headers()
            .get(WWW_AUTHENTICATE)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("")
            .to_string();
        let scheme = challenge.split_whitespace().next().unwrap_or("").to_ascii_lowercase();
        Ok(Some((scheme, challenge)))
    }

    /// A token for `operation` on our repository from the token server
    /// that the Bearer `challenge` names (with our credentials, if any).
    /// Its answer is read up to [`MAX_TOKEN_ANSWER`]: past it, an error.
    async fn bearer(&self, challenge: &str, operation: RegistryOperation) -> io::Result<String> {
        let fail = |why: String| io::Error::other(format!("authentication failed: {why}"));
        let parsed = http_auth::parse_challenges(challenge).ok();
        let params = parsed
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.scheme.eq_ignore_ascii_case("bearer")))
            .ok_or_else(|| fail(format!("the registry's Bearer challenge {challenge:?} does not parse")))?;
        let param = |name: &str| {
            params
                .params
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.to_unescaped())
        };
        let realm =
            param("realm").ok_or_else(|| fail(format!("the registry's challenge {challenge:?} names no realm")))?;
        let actions = match operation {
            RegistryOperation::Pull => "pull",
            RegistryOperation::Push => "pull,push",
        };
        let mut query = vec![("scope", format!("repository:{}:{actions}", self.reference.repository()))];
        if let Some(service) = param("service") {
            query.push(("service", service));
        }
        let req = match &self.auth {
            // OAuth2's refresh-token grant, form-encoded in a POST.
            Some(Secret::Identity(t)) => {
                query.extend([
                    ("grant_type", "refresh_token".to_string()),
                    ("refresh_token", t.clone()),
                    ("client_id", "tilefs".to_string()),
                ]);
                self.client.post(&realm).form(&query)
            }
            Some(Secret::Basic { user, password }) => {
                self.client.get(&realm).query(&query).basic_auth(user, Some(password))
            }
            _ => self.client.get(&realm).query(&query),
        };
        let server = |why: String| fail(format!("the token server {realm}: {why}"));
        let resp = req.send().await.map_err(|e| server(with_causes(&e)))?;
        let status = resp.status();
        if status != StatusCode::OK {
            let body = error_body(resp).await;
            return Err(server(format!("HTTP {status}{body} ({})", self.auth_source)));
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| server(with_causes(&e)))?;
            if (body.len() + chunk.len()) as u64 > MAX_TOKEN_ANSWER {
                return Err(server(format!(
                    "its answer passes {} (the limit)",
                    bounded::size(MAX_TOKEN_ANSWER)
                )));
            }
            body.extend_from_slice(&chunk);
        }
        #[derive(serde::Deserialize)]
        struct Answer {
            token: Option<String>,
            access_token: Option<String>,
        }
        let answer: Answer =
            serde_json::from_slice(&body).map_err(|e| server(format!("its answer is not a token ({e})")))?;
        answer
            .token
            .or(answer.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| server("its answer holds no token".into()))
    }
}

/// The GET `get` asks for, of `url` through `client`, with `headers`
/// (hosts.toml's).
fn request(client: &reqwest::Client, url: &str, get: &Get, headers: &[(String, String)]) -> reqwest::RequestBuilder {
    let mut req = client.get(url);
    for (name, value) in headers {
        req = req.header(name.as_str(), value.as_str());
    }
    if let Some(a) = &get.accept {
        req = req.header(ACCEPT, a);
    }
    if let Some((offset, len)) = get.range {
        let end = (offset + len).saturating_sub(1);
        req = req.header(RANGE, format!("bytes={offset}-{end}"));
    }
    req
}

/// Whether `status` answers `get` with its data.
fn answered(status: StatusCode, get: &Get) -> bool {
    status == StatusCode::OK || status == StatusCode::PARTIAL_CONTENT && get.range.is_some()
}

/// The Authorization header each registry's challenge asked for, by
/// [`Http::learnt_key`] (in memory only; a token the registry refuses is
/// asked for again, once).
static LEARNT: std::sync::Mutex<Option<std::collections::HashMap<String, Option<HeaderValue>>>> =
    std::sync::Mutex::new(None);
const MAX_LEARNT: usize = 256;

/// A digest of `auth`'s secret, to tell entries apart without keeping it
/// in a key.
fn fingerprint(auth: &Option<Secret>) -> String {
    let s = match auth {
        None => return "anonymous".into(),
        Some(Secret::Basic { user, password }) => format!("basic\n{user}\n{password}"),
        Some(Secret::Token(t)) => format!("bearer\n{t}"),
        Some(Secret::Identity(t)) => format!("identity\n{t}"),
    };
    Digest::sha256_of(s.as_bytes()).to_string()
}

fn sensitive(v: String) -> io::Result<Option<HeaderValue>> {
    let mut h = HeaderValue::from_str(&v).map_err(|_| io::Error::other("credentials that are not a valid header"))?;
    h.set_sensitive(true);
    Ok(Some(h))
}

/// The first part of an error answer's body, for its message: what the
/// registry said in a distribution-API error, else its first line.
async fn error_body(resp: reqwest::Response) -> String {
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        body.extend_from_slice(&chunk);
        if body.len() as u64 >= MAX_ERROR_BODY {
            break;
        }
    }
    if let Ok(envelope) = serde_json::from_slice::<oci_client::errors::OciEnvelope>(&body) {
        if !envelope.errors.is_empty() {
            return format!(": {}", said(&envelope));
        }
    }
    let text = String::from_utf8_lossy(&body);
    match text.lines().map(str::trim).find(|l| !l.is_empty()) {
        Some(line) => format!(": {}", line.chars().take(200).collect::<String>()),
        None => String::new(),
    }
}

impl Registry {
    /// Whether the repository has blob `d`.
    pub fn has_blob(&self, d: &Digest) -> Result<bool, OciError> {
        let digest = d.to_string();
        let what = format!("blob {d}");
        let fut = self.client(&what)?.blob_exists(&self.reference, &digest);
        self.run(&what, fut)
    }

    /// Asks the registry to link blob `d` from repository `from` (same
    /// registry) into ours; false when it will not.
    pub fn mount_from(&self, d: &Digest, from: &str) -> bool {
        let Ok(source) = format!("{}/{from}", self.registry).parse::<Reference>() else {
            return false;
        };
        let digest = d.to_string();
        let Ok(client) = self.client("mount") else {
            return false;
        };
        let fut = client.mount_blob(&self.reference, &source, &digest);
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
        let client = self.client(&format!("upload of blob {d}"))?;
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
            let push = client.push_blob_stream(&self.reference, stream, &digest, Some(size));
            let stalled = async {
                let mut last = (taken.load(Relaxed), tokio::time::Instant::now());
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                    let now = taken.load(Relaxed);
                    if self.limits.cancelled() {
                        return;
                    }
                    if now != last.0 {
                        last = (now, tokio::time::Instant::now());
                    } else if last.1.elapsed() >= self.limits.timeout {
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
                        self.limits.timeout.as_secs()
                    ))))
                }
            };
            let read = reader
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the reading thread failed")));
            (r, read)
        });
        if self.limits.cancelled() {
            return Err(OciError::Interrupted);
        }
        if let Err(e) = read {
            return Err(self.error(&format!("blob {d}"), format!("cannot read what to upload: {e}")));
        }
        r.map(drop)
            .map_err(|e| self.client_error(&format!("upload of blob {d}"), e))
    }

    /// Puts `manifest` under the reference's tag; returns the URL.
    pub fn put_manifest(&self, manifest: Vec<u8>) -> Result<String, OciError> {
        let fut = self.client("manifest")?.push_manifest_raw(
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

    /// Runs a client call with the timeout, until cancelled.
    fn run<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, oci_client::errors::OciDistributionError>>,
    ) -> Result<T, OciError> {
        self.within(what, fut)?.map_err(|e| self.client_error(what, e))
    }

    /// Runs `fut` with the timeout, until cancelled.
    fn within<T>(&self, what: &str, fut: impl std::future::Future<Output = T>) -> Result<T, OciError> {
        let limits = &self.limits;
        self.rt
            .block_on(async {
                let work = tokio::time::timeout(limits.timeout, fut);
                let stop = cancelled(limits);
                futures_util::pin_mut!(work, stop);
                match futures_util::future::select(work, stop).await {
                    futures_util::future::Either::Left((r, _)) => Some(r),
                    futures_util::future::Either::Right(_) => None,
                }
            })
            .ok_or(OciError::Interrupted)?
            .map_err(|_| self.timed_out(what))
    }

    /// oci-client, for uploads, its credentials set first: it is given a
    /// token we asked for (see [`Http::bearer`]) rather than left to ask.
    /// `what` names the operation it is for in messages.
    fn client(&self, what: &str) -> Result<&Client, OciError> {
        if self.client_auth.get().is_none() {
            let auth = self.within(what, self.http.push_auth())?.map_err(|e| match e.kind() {
                io::ErrorKind::TimedOut => self.timed_out(what),
                _ => self.read_error(what, e),
            })?;
            self.rt
                .block_on(self.client.store_auth_if_needed(&self.registry, &auth));
            let _ = self.client_auth.set(());
        }
        Ok(&self.client)
    }
}

/// The HTTP client for the registry, or for `host` of its hosts.toml (its
/// TLS settings besides `opts`').
fn http_client(opts: &RegistryOptions, host: Option<&super::hosts::Host>) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder()
        .danger_accept_invalid_certs(!opts.tls_verify || host.is_some_and(|h| h.skip_verify))
        .connect_timeout(opts.timeout)
        .read_timeout(opts.timeout)
        .redirect(reqwest::redirect::Policy::custom(|a| {
            if a.previous().len() >= 10 {
                a.error("more than 10 redirects")
            } else if !matches!(a.url().scheme(), "http" | "https") {
                let to = a.url().to_string();
                a.error(format!("redirected to {to}, which is not an HTTP(S) URL"))
            } else {
                a.follow()
            }
        }))
        .user_agent(concat!("tilefs/", env!("CARGO_PKG_VERSION")));
    for ca in host.map(|h| h.ca.as_slice()).unwrap_or_default() {
        let pem = std::fs::read(ca).map_err(|e| format!("ca {}: cannot read: {e}", ca.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| format!("ca {}: not PEM certificates: {}", ca.display(), with_causes(&e)))?;
        b = b.tls_certs_merge(certs);
    }
    b.build().map_err(|e| with_causes(&e))
}

/// Ends once `limits` is cancelled.
async fn cancelled(limits: &Limits) {
    while !limits.cancelled() {
        tokio::time::sleep(POLL).await;
    }
}

/// How often a wait looks whether it was cancelled.
const POLL: Duration = Duration::from_millis(100);

/// The reading end of a GET: its answer's bytes, as they come, within the
/// transfer's [`Limits`].
struct ChannelReader {
    rx: mpsc::Receiver<io::Result<bytes::Bytes>>,
    current: bytes::Bytes,
    done: bool,
    /// How much should come (a blob's size, a range's length), and how
    /// much has.
    expected: Option<u64>,
    received: u64,
    handle: tokio::runtime::Handle,
    limits: Limits,
    /// When the whole answer must have come.
    deadline: Option<Instant>,
    /// Time spent waiting for data in the current window, and the bytes
    /// that came in it: a window closes after `limits.timeout` of waiting
    /// (a reader that is slow itself does not count against the server).
    window: (Duration, u64),
    /// Why a server that sent nothing failed.
    silent: String,
    /// Put before the messages of the errors the reader makes.
    context: String,
    /// Why the transfer failed, once it has.
    failed: Option<io::Error>,
}

impl ChannelReader {
    fn fail(&mut self, kind: io::ErrorKind, why: String) -> io::Error {
        let e = io::Error::new(kind, format!("{}{why}", self.context));
        self.failed = Some(io::Error::new(e.kind(), e.to_string()));
        e
    }

    /// Waits up to [`POLL`] for the next piece; Ok(false) when none came.
    fn wait(&mut self) -> io::Result<bool> {
        if self.limits.cancelled() {
            return Err(self.fail(io::ErrorKind::Other, "interrupted".into()));
        }
        let now = Instant::now();
        let slice = match self.deadline {
            Some(d) if now >= d => {
                let t = self.limits.timeout.as_secs();
                let why = match self.received {
                    0 => self.silent.clone(),
                    n => format!("not complete within {t} s (--timeout; {n} bytes came)"),
                };
                return Err(self.fail(io::ErrorKind::TimedOut, why));
            }
            Some(d) => POLL.min(d - now),
            None => POLL,
        };
        let next = self
            .handle
            .block_on(async { tokio::time::timeout(slice, self.rx.recv()).await });
        self.window.0 += now.elapsed();
        let came = match next {
            Err(_) => false,
            Ok(Some(Ok(b))) => {
                self.received += b.len() as u64;
                self.window.1 += b.len() as u64;
                self.current = b;
                true
            }
            Ok(Some(Err(e))) => {
                // Once every byte has come, an error at the end is not the
                // caller's concern: it checks the bytes itself and says
                // precisely what is wrong with them.
                if self.expected == Some(self.received) {
                    self.done = true;
                    return Ok(false);
                }
                let why = match (e.kind(), self.received) {
                    (io::ErrorKind::TimedOut, 0) => self.silent.clone(),
                    _ => e.to_string(),
                };
                return Err(self.fail(e.kind(), why));
            }
            // The sender finished: the answer is complete.
            Ok(None) => {
                self.done = true;
                true
            }
        };
        let (waited, bytes) = self.window;
        if waited >= self.limits.timeout {
            let t = self.limits.timeout.as_secs().max(1);
            if bytes == 0 {
                let why = match self.received {
                    0 => self.silent.clone(),
                    _ => format!("no data for {t} s (--timeout)"),
                };
                return Err(self.fail(io::ErrorKind::TimedOut, why));
            }
            if bytes < self.limits.min_rate.saturating_mul(t) {
                let why = format!(
                    "{bytes} bytes in {t} s, less than {} bytes/s (--min-rate)",
                    self.limits.min_rate
                );
                return Err(self.fail(io::ErrorKind::TimedOut, why));
            }
            self.window = (Duration::ZERO, 0);
        }
        Ok(came)
    }
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            // A transfer that failed fails every read after (a reader that
            // reads on does not take it for the end).
            if let Some(e) = &self.failed {
                return Err(io::Error::new(e.kind(), e.to_string()));
            }
            if self.done {
                return Ok(0);
            }
            self.wait()?;
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
        self.try_manifest(&r)
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

    /// A whole small blob, at most `limit` bytes, checked against its
    /// digest.
    pub fn blob_bytes(&self, blob: &BlobRef, limit: u64) -> Result<Vec<u8>, OciError> {
        let r = super::read_checked(self.blob_stream(blob, None), &blob.digest, limit, "blob");
        if self.limits.cancelled() {
            return Err(OciError::Interrupted);
        }
        r
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
        let fut = self.client("manifest")?.push_manifest_raw(&r, manifest, header);
        self.run("manifest", fut)
    }

    /// Puts `manifest` (of `media_type`) by its digest `d`, untagged (a
    /// referrer, which its subject's list names).
    pub fn put_manifest_by_digest(&self, d: &Digest, manifest: Vec<u8>, media_type: &str) -> Result<String, OciError> {
        let r = self.reference.clone_with_digest(d.to_string());
        let header = media_type
            .parse()
            .map_err(|_| self.error("manifest", format!("invalid media type {media_type:?}")))?;
        let fut = self.client.push_manifest_raw(&r, manifest, header);
        self.run("manifest", fut)
    }

    /// The referrers API's list of the manifests that refer to `subject`
    /// with `artifact_type` (an OCI image index; a registry may ignore the
    /// filter), or None where the registry has no such API (404).
    pub fn referrers(&self, subject: &Digest, artifact_type: &str) -> Result<Option<Vec<u8>>, OciError> {
        let filter: String = artifact_type
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
                b => format!("%{b:02X}"),
            })
            .collect();
        self.document(
            format!(
                "{}/v2/{}/referrers/{subject}?artifactType={filter}",
                self.http.base,
                self.reference.repository()
            ),
            Some(crate::manifest::OCI_INDEX.to_string()),
            true,
            MAX_MANIFEST,
            &format!("referrers of {subject}"),
        )
    }

    /// GETs `url` (a lookaside signature store) with this registry's TLS
    /// settings and limits, without its credentials: the body, at most
    /// `limit` bytes, or None for a 404.
    pub fn http_get(&self, url: &str, limit: u64) -> Result<Option<Vec<u8>>, String> {
        self.document(url.to_string(), None, false, limit, url)
            .map_err(|e| match e {
                OciError::Registry { reason, .. } => reason,
                e => e.to_string(),
            })
    }
}
