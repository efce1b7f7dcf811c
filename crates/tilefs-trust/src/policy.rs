//! The signature verification policy, containers-policy.json(5): parsed
//! strictly (an unknown, duplicated or invalid member refuses the whole
//! file), scopes looked up most specific first, every requirement of the
//! scope must accept the image.

use crate::dockerref::{DockerRef, RefError};
use crate::error::Error;
use crate::payload::{self, Claim};
use crate::sigstore::SigstoreSignature;
use base64::Engine;
use serde_json::{Map, Value};
use std::cell::OnceCell;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A policy file, parsed.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Where it came from, for messages.
    pub origin: String,
    default: Vec<Requirement>,
    transports: BTreeMap<String, BTreeMap<String, Vec<Requirement>>>,
    /// Key files are read only if root alone could have written them
    /// ([`crate::rootfile`]): the policy of a root service.
    roots_keys: bool,
}

/// Where a key comes from: files are read when the requirement is
/// evaluated (as containers/image does), so a policy with a missing key
/// for one scope still serves the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Paths(Vec<PathBuf>),
    Data(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    InsecureAcceptAnything,
    Reject,
    SignedBy { keys: KeySource, identity: IdentityRule },
    SigstoreSigned { keys: KeySource, identity: IdentityRule },
}

/// `signedIdentity`: what the signature's claimed reference must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityRule {
    MatchExact,
    MatchRepoDigestOrExact,
    MatchRepository,
    ExactReference(DockerRef),
    ExactRepository(DockerRef),
    RemapIdentity { prefix: String, signed_prefix: String },
}

/// The image a policy decides about.
#[derive(Debug, Clone)]
pub struct Subject {
    /// The transport's name in policy.json (`docker`, `oci`, ...).
    pub transport: String,
    /// The most specific scope (`HOST/REPO:TAG`, `/DIR:NAME`).
    pub identity: String,
    /// More general scopes, most specific first.
    pub namespaces: Vec<String>,
    /// The image's docker reference, where the transport has one (what
    /// `signedIdentity` compares signatures' claims with).
    pub docker_ref: Option<DockerRef>,
    /// How to name the image in messages (`docker://...`).
    pub display: String,
}

impl Subject {
    /// An image in a registry, by its (logical) reference.
    pub fn docker(r: &DockerRef) -> Subject {
        Subject {
            transport: "docker".into(),
            identity: r.identity(),
            namespaces: r.namespaces(),
            docker_ref: Some(r.clone()),
            display: format!("docker://{r}"),
        }
    }

    /// An image in a local file or directory (`oci`, `oci-archive`,
    /// `docker-archive`): scopes are the absolute path with the name
    /// (`PATH:NAME`), the path, then its parent directories.
    pub fn path(transport: &str, path: &Path, name: Option<&str>, display: String) -> Subject {
        let abs = std::fs::canonicalize(path).unwrap_or_else(|_| {
            if path.is_absolute() {
                path.to_path_buf()
            } else {
                std::env::current_dir().unwrap_or_default().join(path)
            }
        });
        let p = abs.to_string_lossy().into_owned();
        let mut namespaces = Vec::new();
        let identity = match name {
            Some(n) => {
                namespaces.push(p.clone());
                format!("{p}:{n}")
            }
            None => p.clone(),
        };
        let mut cur = abs.parent();
        while let Some(d) = cur {
            if d == Path::new("/") {
                break;
            }
            namespaces.push(d.to_string_lossy().into_owned());
            cur = d.parent();
        }
        Subject {
            transport: transport.into(),
            identity,
            namespaces,
            docker_ref: None,
            display,
        }
    }
}

/// Why a [`SignatureSource`] could not read signatures (its own error).
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// [`SourceError`], kept for every requirement that needs the signatures.
pub type Shared = Arc<dyn std::error::Error + Send + Sync>;

/// Where signatures of an image are, fetched only when a requirement
/// needs them.
pub trait SignatureSource {
    /// Simple signing signatures (OpenPGP messages).
    fn simple(&self) -> Result<Vec<Vec<u8>>, SourceError>;
    /// Sigstore signatures (payload and base64 signature).
    fn sigstore(&self) -> Result<Vec<SigstoreSignature>, SourceError>;
    /// Where simple signatures were looked for, for messages.
    fn simple_origin(&self) -> String;
    /// Where sigstore signatures were looked for, for messages.
    fn sigstore_origin(&self) -> String;
}

/// A source with no signatures (local layouts and archives).
pub struct NoSignatures(pub &'static str);

impl SignatureSource for NoSignatures {
    fn simple(&self) -> Result<Vec<Vec<u8>>, SourceError> {
        Ok(Vec::new())
    }
    fn sigstore(&self) -> Result<Vec<SigstoreSignature>, SourceError> {
        Ok(Vec::new())
    }
    fn simple_origin(&self) -> String {
        self.0.to_string()
    }
    fn sigstore_origin(&self) -> String {
        self.0.to_string()
    }
}

/// Which scope of the policy applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// `transports.T.S`.
    Scope { transport: String, scope: String },
    /// `transports.T.""`.
    TransportDefault(String),
    /// `default`.
    Default,
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scope::Scope { transport, scope } => write!(f, "scope {scope:?} of transport {transport}"),
            Scope::TransportDefault(t) => write!(f, "the default of transport {t}"),
            Scope::Default => write!(f, "the global default"),
        }
    }
}

/// An image the policy accepted, and how.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub scope: Scope,
    /// What accepted it (`insecureAcceptAnything`, `signedBy: key FPR`, ...).
    pub by: Vec<String>,
}

/// An image the policy refused: which image, which scope, why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{image} is refused by the signature policy {policy} ({scope}): {reason}")]
pub struct Refusal {
    pub image: String,
    pub policy: String,
    pub scope: Scope,
    pub reason: Box<Rejection>,
}

/// The requirements that need signatures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signed {
    /// `signedBy`: simple signing, OpenPGP keys.
    By,
    /// `sigstoreSigned`: sigstore signatures, public keys.
    Sigstore,
}

impl fmt::Display for Signed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Signed::By => "signedBy",
            Signed::Sigstore => "sigstoreSigned",
        })
    }
}

/// Which requirement refused the image, and why.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Rejection {
    /// `reject`.
    #[error("the policy rejects every image here (reject)")]
    Reject,
    /// The requirement's keys cannot be read or used.
    #[error("{requirement}: cannot use its keys: {error}")]
    Keys { requirement: Signed, error: Error },
    /// The image's signatures cannot be read.
    #[error("{requirement}: cannot read signatures: {error}")]
    Unreadable { requirement: Signed, error: Shared },
    /// The image has no signature of that kind.
    #[error("{requirement}: no signature (none found in {searched})")]
    Unsigned { requirement: Signed, searched: String },
    /// No signature satisfies the requirement: each one's reason.
    #[error("{requirement}: no signature is acceptable ({})", list(signatures))]
    NoneAcceptable {
        requirement: Signed,
        signatures: Vec<BadSignature>,
    },
    /// The record the image is judged from again cannot be used.
    #[error("its trust record: {0}")]
    Record(Error),
}

fn list(v: &[BadSignature]) -> String {
    v.iter().map(|b| b.to_string()).collect::<Vec<_>>().join("; ")
}

/// One signature that does not satisfy a requirement (numbered from 1).
#[derive(Debug, Clone, thiserror::Error)]
#[error("signature {index}: {fault}")]
pub struct BadSignature {
    pub index: usize,
    pub fault: SignatureFault,
}

/// Why a signature does not satisfy a requirement.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SignatureFault {
    /// Its cryptography or payload does not check out.
    #[error(transparent)]
    Invalid(#[from] Error),
    /// It signs another manifest.
    #[error("it signs another image (manifest {claimed}, not this one)")]
    OtherImage { claimed: String },
    /// Its claimed identity is not a reference.
    #[error("its identity is not a docker reference: {0}")]
    BadIdentity(RefError),
    /// Its claimed identity is one the rule does not accept for the image.
    #[error("it claims the identity {claimed}, which {rule} does not accept for {image}")]
    Identity {
        claimed: Box<DockerRef>,
        rule: Box<IdentityRule>,
        image: String,
    },
}

fn bad(what: &str, reason: impl Into<String>) -> Error {
    Error::invalid(what, reason)
}

fn check_keys(o: &Map<String, Value>, what: &str, allowed: &[&str]) -> Result<(), Error> {
    for k in o.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(bad(what, format!("unknown member {k:?}")));
        }
    }
    Ok(())
}

fn get_str<'a>(o: &'a Map<String, Value>, k: &str, what: &str) -> Result<Option<&'a str>, Error> {
    match o.get(k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(bad(what, format!("{k} is not a string"))),
    }
}

fn parse_keys(o: &Map<String, Value>, what: &str, multi: bool) -> Result<KeySource, Error> {
    let path = get_str(o, "keyPath", what)?;
    let paths = match o.get("keyPaths") {
        None => None,
        Some(Value::Array(a)) if multi => Some(
            a.iter()
                .map(|v| v.as_str().map(PathBuf::from))
                .collect::<Option<Vec<_>>>()
                .filter(|v| !v.is_empty())
                .ok_or_else(|| bad(what, "keyPaths is not a non-empty list of strings"))?,
        ),
        Some(_) => return Err(bad(what, "keyPaths is not a non-empty list of strings")),
    };
    let data = get_str(o, "keyData", what)?;
    match (path, paths, data) {
        (Some(p), None, None) => {
            if p.is_empty() {
                return Err(bad(what, "keyPath is empty"));
            }
            Ok(KeySource::Paths(vec![PathBuf::from(p)]))
        }
        (None, Some(ps), None) => Ok(KeySource::Paths(ps)),
        (None, None, Some(d)) => base64::engine::general_purpose::STANDARD
            .decode(d)
            .map(KeySource::Data)
            .map_err(|_| bad(what, "keyData is not base64")),
        _ => Err(bad(
            what,
            format!(
                "exactly one of {} must be present",
                if multi {
                    "keyPath, keyPaths and keyData"
                } else {
                    "keyPath and keyData"
                }
            ),
        )),
    }
}

fn parse_identity(v: Option<&Value>, what: &str) -> Result<IdentityRule, Error> {
    let Some(v) = v else {
        return Ok(IdentityRule::MatchRepoDigestOrExact);
    };
    let what = format!("{what}: signedIdentity");
    let o = v.as_object().ok_or_else(|| bad(&what, "not an object"))?;
    let t = get_str(o, "type", &what)?.ok_or_else(|| bad(&what, "no type"))?;
    let bare = |rule: IdentityRule| -> Result<IdentityRule, Error> {
        check_keys(o, &what, &["type"])?;
        Ok(rule)
    };
    match t {
        "matchExact" => bare(IdentityRule::MatchExact),
        "matchRepoDigestOrExact" => bare(IdentityRule::MatchRepoDigestOrExact),
        "matchRepository" => bare(IdentityRule::MatchRepository),
        "exactReference" => {
            check_keys(o, &what, &["type", "dockerReference"])?;
            let r = get_str(o, "dockerReference", &what)?.ok_or_else(|| bad(&what, "no dockerReference"))?;
            let r = DockerRef::parse_normalized(r).map_err(|e| bad(&what, e.to_string()))?;
            if r.tag.is_none() && r.digest.is_none() {
                return Err(bad(
                    &what,
                    format!("dockerReference {r} has neither a tag nor a digest"),
                ));
            }
            Ok(IdentityRule::ExactReference(r))
        }
        "exactRepository" => {
            check_keys(o, &what, &["type", "dockerRepository"])?;
            let r = get_str(o, "dockerRepository", &what)?.ok_or_else(|| bad(&what, "no dockerRepository"))?;
            let r = DockerRef::parse_normalized(r).map_err(|e| bad(&what, e.to_string()))?;
            Ok(IdentityRule::ExactRepository(r))
        }
        "remapIdentity" => {
            check_keys(o, &what, &["type", "prefix", "signedPrefix"])?;
            let p = get_str(o, "prefix", &what)?.ok_or_else(|| bad(&what, "no prefix"))?;
            let s = get_str(o, "signedPrefix", &what)?.ok_or_else(|| bad(&what, "no signedPrefix"))?;
            let (p, s) = (crate::dockerref::lower_host(p), crate::dockerref::lower_host(s));
            for x in [&p, &s] {
                if !valid_prefix(x) {
                    return Err(bad(
                        &what,
                        format!("{x:?} is not a host[:port], namespace or repository in the fully expanded form"),
                    ));
                }
            }
            Ok(IdentityRule::RemapIdentity {
                prefix: p,
                signed_prefix: s,
            })
        }
        other => Err(bad(&what, format!("unknown type {other:?}"))),
    }
}

/// A host, namespace or repository without tag or digest, fully expanded.
fn valid_prefix(p: &str) -> bool {
    if p.contains('/') {
        DockerRef::parse_qualified(p).is_ok_and(|r| r.tag.is_none() && r.digest.is_none() && r.name() == p)
    } else {
        crate::dockerref::valid_domain(p)
    }
}

fn parse_requirement(v: &Value, what: &str) -> Result<Requirement, Error> {
    let o = v.as_object().ok_or_else(|| bad(what, "not an object"))?;
    let t = get_str(o, "type", what)?.ok_or_else(|| bad(what, "no type"))?;
    let what = format!("{what} ({t})");
    match t {
        "insecureAcceptAnything" => {
            check_keys(o, &what, &["type"])?;
            Ok(Requirement::InsecureAcceptAnything)
        }
        "reject" => {
            check_keys(o, &what, &["type"])?;
            Ok(Requirement::Reject)
        }
        "signedBy" => {
            check_keys(
                o,
                &what,
                &["type", "keyType", "keyPath", "keyPaths", "keyData", "signedIdentity"],
            )?;
            match get_str(o, "keyType", &what)? {
                Some("GPGKeys") => {}
                Some(k) => return Err(bad(&what, format!("keyType {k:?} is not supported (GPGKeys is)"))),
                None => return Err(bad(&what, "no keyType")),
            }
            Ok(Requirement::SignedBy {
                keys: parse_keys(o, &what, true)?,
                identity: parse_identity(o.get("signedIdentity"), &what)?,
            })
        }
        "sigstoreSigned" => {
            for k in ["fulcio", "rekorPublicKeyPath", "rekorPublicKeyData", "pki"] {
                if o.contains_key(k) {
                    return Err(bad(
                        &what,
                        format!("{k} (keyless signing) is not supported by tilefs: use keyPath or keyData"),
                    ));
                }
            }
            check_keys(o, &what, &["type", "keyPath", "keyPaths", "keyData", "signedIdentity"])?;
            Ok(Requirement::SigstoreSigned {
                keys: parse_keys(o, &what, true)?,
                identity: parse_identity(o.get("signedIdentity"), &what)?,
            })
        }
        other => Err(bad(&what, format!("unknown requirement type {other:?}"))),
    }
}

fn parse_requirements(v: &Value, what: &str) -> Result<Vec<Requirement>, Error> {
    let a = v.as_array().ok_or_else(|| bad(what, "not a list of requirements"))?;
    if a.is_empty() {
        return Err(bad(
            what,
            "empty (use [{\"type\": \"insecureAcceptAnything\"}] to accept anything)".to_string(),
        ));
    }
    a.iter()
        .enumerate()
        .map(|(i, r)| parse_requirement(r, &format!("{what}[{i}]")))
        .collect()
}

/// Checks a scope's syntax for its transport.
fn check_scope(transport: &str, scope: &str) -> Result<(), Error> {
    if scope.is_empty() {
        return Ok(());
    }
    let what = format!("transports.{transport}");
    match transport {
        "docker" | "atomic" => {
            if let Some(domain) = scope.strip_prefix("*.") {
                return if !domain.is_empty()
                    && !domain.contains(['*', '/', ':'])
                    && DockerRef::parse_qualified(&format!("{domain}/x")).is_ok()
                {
                    Ok(())
                } else {
                    Err(bad(
                        &what,
                        format!("{scope:?} is not a valid wildcard scope (*.example.com)"),
                    ))
                };
            }
            let ok = if scope.contains('/') {
                DockerRef::parse_qualified(scope).is_ok_and(|r| r.to_string() == scope)
            } else {
                crate::dockerref::valid_domain(scope)
            };
            if ok {
                Ok(())
            } else {
                Err(bad(
                    &what,
                    format!(
                        "{scope:?} is not a registry, namespace, repository or image in the fully expanded form \
                         (docker.io/library/busybox, not busybox)"
                    ),
                ))
            }
        }
        "oci" | "oci-archive" | "dir" | "docker-archive" => {
            if !scope.starts_with('/') || scope == "/" {
                Err(bad(&what, format!("{scope:?} is not an absolute path other than /")))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

impl Policy {
    /// Parses policy.json text; `origin` names it in messages.
    pub fn parse(raw: &[u8], origin: &str) -> Result<Policy, Error> {
        Policy::parse_inner(raw)
            .map_err(|e| e.within(origin))
            .map(|(default, transports)| Policy {
                origin: origin.to_string(),
                default,
                transports,
                roots_keys: false,
            })
    }

    #[allow(clippy::type_complexity)]
    fn parse_inner(
        raw: &[u8],
    ) -> Result<(Vec<Requirement>, BTreeMap<String, BTreeMap<String, Vec<Requirement>>>), Error> {
        crate::payload::check_json(raw).map_err(|e| bad("not valid JSON", e.to_string()))?;
        let v: Value = serde_json::from_slice(raw).map_err(|e| bad("not JSON", e.to_string()))?;
        let top = v.as_object().ok_or_else(|| bad("the policy", "not a JSON object"))?;
        check_keys(top, "the policy", &["default", "transports"])?;
        let default = parse_requirements(
            top.get("default")
                .ok_or_else(|| bad("the policy", "no \"default\" requirements (they are mandatory)"))?,
            "default",
        )?;
        let mut transports = BTreeMap::new();
        match top.get("transports") {
            None | Some(Value::Null) => {}
            Some(Value::Object(ts)) => {
                for (t, scopes) in ts {
                    let what = format!("transports.{t}");
                    let scopes = scopes.as_object().ok_or_else(|| bad(&what, "not an object"))?;
                    let mut m = BTreeMap::new();
                    for (s, reqs) in scopes {
                        // Host names as references keep them (lower case).
                        let key = match t.as_str() {
                            "docker" | "atomic" => crate::dockerref::lower_host(s),
                            _ => s.clone(),
                        };
                        check_scope(t, &key)?;
                        let reqs = parse_requirements(reqs, &format!("{what}.{s:?}"))?;
                        if m.insert(key, reqs).is_some() {
                            return Err(bad(
                                &what,
                                format!("scope {s:?} is given twice (host names have no case)"),
                            ));
                        }
                    }
                    transports.insert(t.clone(), m);
                }
            }
            Some(_) => return Err(bad("transports", "not an object")),
        }
        Ok((default, transports))
    }

    /// Reads and parses a policy file.
    pub fn load(path: &Path) -> Result<Policy, Error> {
        let raw = crate::read_config(path).map_err(|e| Error::read(path, e))?;
        Policy::parse(&raw, &path.display().to_string())
    }

    /// Reads and parses the policy file of a service running as root:
    /// it, and every key file it names, read only if root alone could have
    /// written them ([`crate::rootfile`]).
    pub fn load_roots(path: &Path) -> Result<Policy, Error> {
        let raw = crate::rootfile::read_existing(path, crate::MAX_CONFIG)?;
        let mut p = Policy::parse(&raw, &path.display().to_string())?;
        p.roots_keys = true;
        Ok(p)
    }

    /// The requirements for `s`, and the scope they came from.
    pub fn requirements_for(&self, s: &Subject) -> (Scope, &[Requirement]) {
        if let Some(scopes) = self.transports.get(&s.transport) {
            for cand in std::iter::once(&s.identity).chain(&s.namespaces) {
                if let Some(r) = scopes.get(cand) {
                    return (
                        Scope::Scope {
                            transport: s.transport.clone(),
                            scope: cand.clone(),
                        },
                        r,
                    );
                }
            }
            if let Some(r) = scopes.get("") {
                return (Scope::TransportDefault(s.transport.clone()), r);
            }
        }
        (Scope::Default, &self.default)
    }

    /// Whether any requirement for `s` needs signatures (so a caller may
    /// skip fetching them otherwise).
    pub fn needs_signatures(&self, s: &Subject) -> bool {
        self.requirements_for(s)
            .1
            .iter()
            .any(|r| matches!(r, Requirement::SignedBy { .. } | Requirement::SigstoreSigned { .. }))
    }

    /// Decides about the image `s` whose top-level manifest is `manifest`.
    pub fn evaluate(&self, s: &Subject, manifest: &[u8], sigs: &dyn SignatureSource) -> Result<Accepted, Refusal> {
        let (scope, reqs) = self.requirements_for(s);
        let refuse = |reason: Rejection| Refusal {
            image: s.display.clone(),
            policy: self.origin.clone(),
            scope: scope.clone(),
            reason: Box::new(reason),
        };
        let found = Found::default();
        let mut by = Vec::new();
        for r in reqs {
            match r {
                Requirement::InsecureAcceptAnything => by.push("insecureAcceptAnything".to_string()),
                Requirement::Reject => return Err(refuse(Rejection::Reject)),
                Requirement::SignedBy { keys, identity } => {
                    let keys = self.keys(Signed::By, keys).map_err(refuse)?;
                    by.push(found.accept(&keys, sigs, identity, manifest, s).map_err(refuse)?);
                }
                Requirement::SigstoreSigned { keys, identity } => {
                    let keys = self.keys(Signed::Sigstore, keys).map_err(refuse)?;
                    by.push(found.accept(&keys, sigs, identity, manifest, s).map_err(refuse)?);
                }
            }
        }
        Ok(Accepted { scope, by })
    }

    /// A requirement's keys, read and parsed.
    fn keys(&self, requirement: Signed, k: &KeySource) -> Result<Keys, Rejection> {
        let data = match k {
            KeySource::Data(d) => vec![d.clone()],
            KeySource::Paths(ps) => ps
                .iter()
                .map(|p| match self.roots_keys {
                    true => crate::rootfile::read_existing(p, crate::MAX_CONFIG),
                    false => crate::read_config(p).map_err(|e| Error::read(p, e)),
                })
                .collect::<Result<_, _>>()
                .map_err(|error| Rejection::Keys { requirement, error })?,
        };
        let keys = match requirement {
            Signed::By => data
                .iter()
                .map(|d| crate::gpg::parse_keyring(d))
                .collect::<Result<Vec<_>, _>>()
                .map(|c| Keys::Gpg(c.concat())),
            Signed::Sigstore => data
                .iter()
                .map(|d| crate::sigstore::parse_public_key(d))
                .collect::<Result<_, _>>()
                .map(Keys::Sigstore),
        };
        keys.map_err(|error| Rejection::Keys { requirement, error })
    }
}

/// A requirement's keys.
enum Keys {
    Gpg(Vec<sequoia_openpgp::Cert>),
    Sigstore(Vec<crate::sigstore::VerifyingKey>),
}

/// One signature of either kind.
enum Sig<'a> {
    Simple(&'a [u8]),
    Sigstore(&'a SigstoreSignature),
}

impl Keys {
    fn requirement(&self) -> Signed {
        match self {
            Keys::Gpg(_) => Signed::By,
            Keys::Sigstore(_) => Signed::Sigstore,
        }
    }

    /// Checks `sig`'s cryptography: the payload it authenticates, and its
    /// signer's fingerprint where the kind names one.
    fn verify(&self, sig: &Sig) -> Result<(Vec<u8>, Option<String>), Error> {
        match (self, sig) {
            (Keys::Gpg(certs), Sig::Simple(sig)) => {
                crate::gpg::verify(certs, sig).map(|(payload, fpr)| (payload, Some(fpr)))
            }
            (Keys::Sigstore(keys), Sig::Sigstore(sig)) => {
                let mut r = Err(Error::Key("no key".into()));
                for k in keys {
                    r = crate::sigstore::verify(k, sig);
                    if r.is_ok() {
                        break;
                    }
                }
                r.map(|()| (sig.payload.clone(), None))
            }
            _ => unreachable!("signatures are read for their keys' kind"),
        }
    }
}

/// The signatures of an image, read once whichever requirements need them.
#[derive(Default)]
struct Found {
    simple: OnceCell<Result<Vec<Vec<u8>>, Shared>>,
    sigstore: OnceCell<Result<Vec<SigstoreSignature>, Shared>>,
}

impl Found {
    /// The signatures of the kind `requirement` checks, and where they
    /// were looked for.
    fn of(&self, requirement: Signed, sigs: &dyn SignatureSource) -> Result<(Vec<Sig<'_>>, String), Rejection> {
        let unreadable = |e: &Shared| Rejection::Unreadable {
            requirement,
            error: e.clone(),
        };
        Ok(match requirement {
            Signed::By => (
                (self.simple.get_or_init(|| sigs.simple().map_err(Arc::from)).as_ref())
                    .map_err(unreadable)?
                    .iter()
                    .map(|s| Sig::Simple(s))
                    .collect(),
                sigs.simple_origin(),
            ),
            Signed::Sigstore => (
                (self
                    .sigstore
                    .get_or_init(|| sigs.sigstore().map_err(Arc::from))
                    .as_ref())
                .map_err(unreadable)?
                .iter()
                .map(Sig::Sigstore)
                .collect(),
                sigs.sigstore_origin(),
            ),
        })
    }

    /// Accepts the image if one of its signatures, checked with `keys`,
    /// signs `manifest` under an identity `rule` accepts: the one loop of
    /// `signedBy` and `sigstoreSigned`, which differ only in how a
    /// signature is verified. Returns how it was accepted.
    fn accept(
        &self,
        keys: &Keys,
        sigs: &dyn SignatureSource,
        rule: &IdentityRule,
        manifest: &[u8],
        s: &Subject,
    ) -> Result<String, Rejection> {
        let requirement = keys.requirement();
        let (found, searched) = self.of(requirement, sigs)?;
        if found.is_empty() {
            return Err(Rejection::Unsigned { requirement, searched });
        }
        let kind = match requirement {
            Signed::By => payload::SIMPLE_SIGNING_TYPE,
            Signed::Sigstore => payload::SIGSTORE_TYPE,
        };
        let mut signatures = Vec::new();
        for (i, sig) in found.iter().enumerate() {
            let r = keys
                .verify(sig)
                .map_err(SignatureFault::from)
                .and_then(|(payload, signer)| {
                    let claim = payload::parse(&payload, kind)?;
                    check_claim(&claim, manifest, s, rule)?;
                    Ok(signer)
                });
            match r {
                Ok(Some(fpr)) => return Ok(format!("{requirement} key {fpr}")),
                Ok(None) => return Ok(requirement.to_string()),
                Err(fault) => signatures.push(BadSignature { index: i + 1, fault }),
            }
        }
        Err(Rejection::NoneAcceptable {
            requirement,
            signatures,
        })
    }
}

/// The claim must be about this manifest and an identity the rule accepts.
fn check_claim(c: &Claim, manifest: &[u8], s: &Subject, rule: &IdentityRule) -> Result<(), SignatureFault> {
    if !crate::digest_matches(&c.manifest_digest, manifest) {
        return Err(SignatureFault::OtherImage {
            claimed: c.manifest_digest.clone(),
        });
    }
    let signed = DockerRef::parse_normalized(&c.docker_reference).map_err(SignatureFault::BadIdentity)?;
    if identity_matches(rule, s.docker_ref.as_ref(), &signed) {
        Ok(())
    } else {
        Err(SignatureFault::Identity {
            claimed: Box::new(signed),
            rule: Box::new(rule.clone()),
            image: s
                .docker_ref
                .as_ref()
                .map_or_else(|| s.display.clone(), |r| r.to_string()),
        })
    }
}

impl fmt::Display for IdentityRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdentityRule::MatchExact => write!(f, "signedIdentity matchExact"),
            IdentityRule::MatchRepoDigestOrExact => write!(f, "signedIdentity matchRepoDigestOrExact"),
            IdentityRule::MatchRepository => write!(f, "signedIdentity matchRepository"),
            IdentityRule::ExactReference(r) => write!(f, "signedIdentity exactReference {r}"),
            IdentityRule::ExactRepository(r) => write!(f, "signedIdentity exactRepository {r}"),
            IdentityRule::RemapIdentity { prefix, signed_prefix } => {
                write!(f, "signedIdentity remapIdentity {prefix} -> {signed_prefix}")
            }
        }
    }
}

fn repo_digest_or_exact(image: &DockerRef, signed: &DockerRef) -> bool {
    if image.digest.is_some() {
        image.name() == signed.name()
    } else {
        image.tag.is_some() && image.to_string() == signed.to_string()
    }
}

/// Whether `signed` (a signature's claim) is acceptable for `image` under
/// `rule`.
pub fn identity_matches(rule: &IdentityRule, image: Option<&DockerRef>, signed: &DockerRef) -> bool {
    match rule {
        IdentityRule::ExactReference(r) => r.to_string() == signed.to_string(),
        IdentityRule::ExactRepository(r) => r.name() == signed.name(),
        _ => {
            let Some(image) = image else {
                return false;
            };
            match rule {
                IdentityRule::MatchExact => {
                    (image.tag.is_some() || image.digest.is_some()) && image.to_string() == signed.to_string()
                }
                IdentityRule::MatchRepoDigestOrExact => repo_digest_or_exact(image, signed),
                IdentityRule::MatchRepository => image.name() == signed.name(),
                IdentityRule::RemapIdentity { prefix, signed_prefix } => {
                    let mapped = image
                        .replace_prefix(prefix, signed_prefix)
                        .unwrap_or_else(|| image.clone());
                    repo_digest_or_exact(&mapped, signed)
                }
                _ => unreachable!(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> DockerRef {
        DockerRef::parse_normalized(s).unwrap()
    }

    #[test]
    fn strict_parsing() {
        let ok = br#"{"default":[{"type":"reject"}],"transports":{"docker":{"127.0.0.1:5000/a":[{"type":"insecureAcceptAnything"}],
            "*.example.com":[{"type":"signedBy","keyType":"GPGKeys","keyPath":"/k.gpg","signedIdentity":{"type":"matchRepository"}}]},
            "oci":{"":[{"type":"insecureAcceptAnything"}]},"atomic":{"x":[{"type":"reject"}]}}}"#;
        Policy::parse(ok, "p").unwrap();
        for bad in [
            &br#"{}"#[..],
            br#"{"default":[]}"#,
            br#"{"default":[{"type":"reject","x":1}]}"#,
            br#"{"default":[{"type":"reject"}],"default":[{"type":"reject"}]}"#,
            br#"{"default":[{"type":"nope"}]}"#,
            br#"{"default":[{"type":"signedBy","keyType":"GPGKeys"}]}"#,
            br#"{"default":[{"type":"signedBy","keyType":"X509","keyPath":"/k"}]}"#,
            br#"{"default":[{"type":"signedBy","keyType":"GPGKeys","keyPath":"/k","keyData":"AA=="}]}"#,
            br#"{"default":[{"type":"sigstoreSigned","keyPath":"/k","signedIdentity":{"type":"matchExact","x":1}}]}"#,
            br#"{"default":[{"type":"sigstoreSigned","fulcio":{}}]}"#,
            br#"{"default":[{"type":"reject"}],"transports":{"docker":{"docker.io/busybox":[{"type":"reject"}]}}}"#,
            br#"{"default":[{"type":"reject"}],"transports":{"oci":{"relative":[{"type":"reject"}]}}}"#,
            br#"{"default":[{"type":"reject"}],"extra":1}"#,
        ] {
            assert!(Policy::parse(bad, "p").is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    /// Issue 43: host names have no case, in references as in scopes: an
    /// image named `LOCALHOST:5000/x` is under the scope of
    /// `localhost:5000/x` (not let through to a laxer default), and a
    /// scope written `Reg.IO` applies to `reg.io`. Repository paths are
    /// compared as written.
    #[test]
    fn host_names_match_scopes_without_regard_to_case() {
        let p = Policy::parse(
            br#"{"default":[{"type":"insecureAcceptAnything"}],"transports":{"docker":{
                "localhost:5000/x":[{"type":"reject"}],
                "Reg.IO/team":[{"type":"reject"}],
                "*.Example.COM":[{"type":"reject"}]}}}"#,
            "p",
        )
        .unwrap();
        for (image, scope) in [
            ("LOCALHOST:5000/x:v1", "localhost:5000/x"),
            (
                "LocalHost:5000/x@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "localhost:5000/x",
            ),
            ("reg.io/team/app", "reg.io/team"),
            ("REG.io/team/app", "reg.io/team"),
            ("a.EXAMPLE.com/x", "*.example.com"),
        ] {
            let s = Subject::docker(&r(image));
            assert!(
                matches!(p.requirements_for(&s).0, Scope::Scope { scope: ref x, .. } if x == scope),
                "{image}"
            );
            assert!(p.evaluate(&s, b"{}", &NoSignatures("nowhere")).is_err(), "{image}");
        }
        assert_eq!(
            p.requirements_for(&Subject::docker(&r("reg.io/teams/x"))).0,
            Scope::Default
        );
        let twice = br#"{"default":[{"type":"reject"}],"transports":{"docker":{"reg.io/x":[{"type":"reject"}],"REG.io/x":[{"type":"reject"}]}}}"#;
        let e = Policy::parse(twice, "p").unwrap_err();
        assert!(
            e.to_string().contains("is given twice (host names have no case)"),
            "{e}"
        );
    }

    #[test]
    fn the_most_specific_scope_wins() {
        let p = Policy::parse(
            br#"{"default":[{"type":"reject"}],"transports":{"docker":{
                "reg.example.com:5000/team/app:v1":[{"type":"insecureAcceptAnything"}],
                "reg.example.com:5000/team":[{"type":"reject"}],
                "*.example.com":[{"type":"insecureAcceptAnything"}],
                "":[{"type":"reject"}]}}}"#,
            "p",
        )
        .unwrap();
        let scope = |s: &str| p.requirements_for(&Subject::docker(&r(s))).0;
        assert_eq!(
            scope("reg.example.com:5000/team/app:v1"),
            Scope::Scope {
                transport: "docker".into(),
                scope: "reg.example.com:5000/team/app:v1".into()
            }
        );
        assert!(
            matches!(scope("reg.example.com:5000/team/app:v2"), Scope::Scope{scope, ..} if scope == "reg.example.com:5000/team")
        );
        assert!(matches!(scope("other.example.com/x"), Scope::Scope{scope, ..} if scope == "*.example.com"));
        assert_eq!(scope("quay.io/x"), Scope::TransportDefault("docker".into()));
        let s = Subject::docker(&r("quay.io/x"));
        let e = p.evaluate(&s, b"{}", &NoSignatures("nowhere")).unwrap_err();
        assert!(e.to_string().contains("docker://quay.io/x:latest") || e.to_string().contains("docker://quay.io/x"));
    }

    #[test]
    fn identities() {
        use IdentityRule::*;
        let d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let tagged = r("reg.io/a/b:1");
        let by_digest = r(&format!("reg.io/a/b@{d}"));
        assert!(identity_matches(&MatchExact, Some(&tagged), &r("reg.io/a/b:1")));
        assert!(!identity_matches(&MatchExact, Some(&tagged), &r("reg.io/a/b:2")));
        assert!(!identity_matches(&MatchExact, Some(&by_digest), &r("reg.io/a/b:1")));
        assert!(identity_matches(
            &MatchRepoDigestOrExact,
            Some(&by_digest),
            &r("reg.io/a/b:1")
        ));
        assert!(!identity_matches(
            &MatchRepoDigestOrExact,
            Some(&tagged),
            &r("reg.io/a/b:2")
        ));
        assert!(identity_matches(&MatchRepository, Some(&tagged), &r("reg.io/a/b:2")));
        assert!(!identity_matches(&MatchRepository, Some(&tagged), &r("reg.io/a/c:1")));
        assert!(identity_matches(
            &ExactReference(r("x.io/y:3")),
            Some(&tagged),
            &r("x.io/y:3")
        ));
        assert!(identity_matches(&ExactRepository(r("x.io/y")), None, &r("x.io/y:9")));
        let remap = RemapIdentity {
            prefix: "reg.io/a".into(),
            signed_prefix: "vendor.io".into(),
        };
        assert!(identity_matches(&remap, Some(&tagged), &r("vendor.io/b:1")));
        assert!(!identity_matches(&remap, Some(&tagged), &r("reg.io/a/b:1")));
        assert!(!identity_matches(&MatchRepository, None, &r("reg.io/a/b:1")));
    }
}
