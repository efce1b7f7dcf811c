//! What a pull keeps of the policy check it passed, so that the image can
//! be judged again later without the network: the image as the policy saw
//! it, its top-level manifest and every signature that was read for it.
//!
//! `tilefs pull` writes one per image it tags (`STORE/.trust/HEX.json`,
//! named by the image's fs-verity digest); the mount service, asked to
//! mount a tag of a store whose rule names a signature policy, re-evaluates
//! it under that policy before it mounts anything, and a snapshotter can do
//! the same for an image already in the store. The signatures are checked
//! again, cryptographically, each time: the record needs no protection of
//! its own beyond the store's (an altered record fails the check).

use crate::policy::{Accepted, Policy, Refusal, Rejection, SignatureSource, SourceError, Subject};
use crate::sigstore::SigstoreSignature;
use crate::{DockerRef, Error, Refused};
use base64::Engine;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The directory of the records in a store.
pub const EVIDENCE_DIR: &str = ".trust";
const VERSION: u32 = 1;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// The record of one accepted image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Evidence {
    pub version: u32,
    /// The transport's name in policy.json (`docker`, `oci`, ...).
    pub transport: String,
    /// The most specific scope (`HOST/REPO:TAG`, or `/DIR:NAME`).
    pub identity: String,
    /// The more general scopes, most specific first.
    pub namespaces: Vec<String>,
    /// The image's docker reference, for a registry image.
    pub docker_reference: Option<String>,
    /// How the image is named in messages.
    pub display: String,
    /// The top-level manifest, base64.
    pub manifest: String,
    /// Simple signatures read (base64 OpenPGP messages).
    pub simple: Vec<String>,
    /// Sigstore signatures read: (payload base64, signature base64).
    pub sigstore: Vec<(String, String)>,
    /// Where the signatures were read, for messages.
    pub origin: String,
    /// How the pull's policy accepted it (for people reading the record).
    pub accepted_by: Vec<String>,
}

impl Evidence {
    /// The record of `subject`, whose top-level manifest is `manifest`,
    /// accepted as `accepted` with the signatures `sigs` held.
    pub fn new(
        subject: &Subject,
        manifest: &[u8],
        simple: &[Vec<u8>],
        sigstore: &[SigstoreSignature],
        origin: String,
        accepted: &Accepted,
    ) -> Evidence {
        Evidence {
            version: VERSION,
            transport: subject.transport.clone(),
            identity: subject.identity.clone(),
            namespaces: subject.namespaces.clone(),
            docker_reference: subject.docker_ref.as_ref().map(|r| r.to_string()),
            display: subject.display.clone(),
            manifest: B64.encode(manifest),
            simple: simple.iter().map(|s| B64.encode(s)).collect(),
            sigstore: sigstore
                .iter()
                .map(|s| (B64.encode(&s.payload), s.signature.clone()))
                .collect(),
            origin,
            accepted_by: accepted
                .by
                .iter()
                .map(|b| format!("{b} ({})", accepted.scope))
                .collect(),
        }
    }

    /// Parses a record.
    pub fn parse(raw: &[u8]) -> Result<Evidence, Error> {
        let e: Evidence =
            serde_json::from_slice(raw).map_err(|e| Error::invalid("not a trust record", e.to_string()))?;
        if e.version != VERSION {
            return Err(Error::invalid(
                "a trust record",
                format!("version {} (this tilefs reads {VERSION})", e.version),
            ));
        }
        Ok(e)
    }

    fn subject(&self) -> Result<Subject, Error> {
        let docker_ref = self
            .docker_reference
            .as_deref()
            .map(DockerRef::parse_normalized)
            .transpose()?;
        Ok(Subject {
            transport: self.transport.clone(),
            identity: self.identity.clone(),
            namespaces: self.namespaces.clone(),
            docker_ref,
            display: self.display.clone(),
        })
    }

    /// Judges the image again under `policy`, with the signatures the pull
    /// read (no network).
    pub fn check(&self, policy: &Policy) -> Result<Accepted, Refusal> {
        let refuse = |reason: Rejection| Refusal {
            image: self.display.clone(),
            policy: policy.origin.clone(),
            scope: crate::policy::Scope::Default,
            reason: Box::new(reason),
        };
        let subject = self.subject().map_err(|e| refuse(Rejection::Record(e)))?;
        let manifest = B64
            .decode(&self.manifest)
            .map_err(|_| refuse(Rejection::Record(Error::invalid("its manifest", "not base64"))))?;
        policy.evaluate(&subject, &manifest, self)
    }
}

impl SignatureSource for Evidence {
    fn simple(&self) -> Result<Vec<Vec<u8>>, SourceError> {
        let bad = || Error::invalid("a recorded simple signature", "not base64");
        Ok(self
            .simple
            .iter()
            .map(|s| B64.decode(s).map_err(|_| bad()))
            .collect::<Result<_, _>>()?)
    }

    fn sigstore(&self) -> Result<Vec<SigstoreSignature>, SourceError> {
        let bad = || Error::invalid("a recorded sigstore payload", "not base64");
        Ok(self
            .sigstore
            .iter()
            .map(|(p, s)| {
                Ok(SigstoreSignature {
                    payload: B64.decode(p).map_err(|_| bad())?,
                    signature: s.clone(),
                })
            })
            .collect::<Result<_, Error>>()?)
    }

    fn simple_origin(&self) -> String {
        format!("the signatures recorded when it was pulled ({})", self.origin)
    }

    fn sigstore_origin(&self) -> String {
        self.simple_origin()
    }
}

/// The record of the image with fs-verity digest `image` in the store at
/// `store`.
pub fn path(store: &Path, image: &[u8; 32]) -> PathBuf {
    let mut hex = String::with_capacity(64);
    for b in image {
        hex.push_str(&format!("{b:02x}"));
    }
    store.join(EVIDENCE_DIR).join(format!("{hex}.json"))
}

/// The most checks kept for one image (one per name it was pulled as,
/// the latest first).
pub const MAX_CHECKS: usize = 16;

/// Reads the records of `image` from `store` (the checks it passed, under
/// each name it was pulled as, the latest first): empty when there are
/// none.
pub fn load(store: &Path, image: &[u8; 32]) -> Result<Vec<Evidence>, Error> {
    let p = path(store, image);
    let raw = match crate::read_config(&p) {
        Ok(raw) => raw,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::read(p, e)),
    };
    parse_list(&raw, &p)
}

/// The records of a `.trust` file's bytes (`origin` names it in errors).
fn parse_list(raw: &[u8], origin: &Path) -> Result<Vec<Evidence>, Error> {
    let origin = origin.display().to_string();
    let list: Vec<serde_json::Value> = serde_json::from_slice(raw)
        .map_err(|e| Error::invalid(&origin, format!("not a list of trust records: {e}")))?;
    list.into_iter()
        .map(|v| Evidence::parse(v.to_string().as_bytes()).map_err(|e| e.within(&origin)))
        .collect()
}

/// Judges again, under `policy`, the image `image` of the store at `store`
/// by its records: accepted if the policy accepts it under any name it was
/// pulled as; refused with every reason, or because it has no record (it
/// did not come in through a checked pull).
pub fn check_stored(store: &Path, image: &[u8; 32], policy: &Policy) -> Result<Accepted, Refused> {
    let checks = load(store, image).map_err(|error| unusable(store, image, error))?;
    check_records(&checks, store, image, policy)
}

/// [`check_stored`] for a record's bytes read by the caller (the mount
/// service reads it through descriptors it has checked): `None` when the
/// image has no record.
pub fn check_record_bytes(
    raw: Option<&[u8]>,
    store: &Path,
    image: &[u8; 32],
    policy: &Policy,
) -> Result<Accepted, Refused> {
    let checks = match raw {
        Some(raw) => parse_list(raw, &path(store, image)).map_err(|error| unusable(store, image, error))?,
        None => Vec::new(),
    };
    check_records(&checks, store, image, policy)
}

/// The image's name in messages: its digest.
fn name(store: &Path, image: &[u8; 32]) -> String {
    path(store, image)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn unusable(store: &Path, image: &[u8; 32], error: Error) -> Refused {
    Refused::Unusable {
        image: format!("the image {}", name(store, image)),
        error,
    }
}

fn check_records(checks: &[Evidence], store: &Path, image: &[u8; 32], policy: &Policy) -> Result<Accepted, Refused> {
    if checks.is_empty() {
        return Err(Refused::NoRecord {
            image: name(store, image),
            store: store.to_path_buf(),
        });
    }
    let mut why = Vec::new();
    for e in checks {
        match e.check(policy) {
            Ok(a) => return Ok(a),
            Err(r) => why.push(r),
        }
    }
    Err(Refused::Records(why))
}

/// Adds the record `e` of `image` to `store`, replacing an earlier check
/// under the same name (replaced atomically: the file is complete before it
/// has its name). Unreadable earlier records are dropped.
pub fn save(store: &Path, image: &[u8; 32], e: &Evidence) -> std::io::Result<()> {
    use std::io::Write;
    let mut checks = load(store, image).unwrap_or_default();
    checks.retain(|c| (&c.transport, &c.identity) != (&e.transport, &e.identity));
    checks.insert(0, e.clone());
    checks.truncate(MAX_CHECKS);
    let p = path(store, image);
    let dir = p.parent().expect("a record has a directory");
    std::fs::create_dir_all(dir)?;
    let json = serde_json::to_vec_pretty(&checks).expect("JSON");
    tilefs_sys::fs::replace(&p, 0o644, |mut f| f.write_all(&json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_checks_again_and_refuses_when_the_policy_changes() {
        let accept = Policy::parse(br#"{"default":[{"type":"insecureAcceptAnything"}]}"#, "a").unwrap();
        let reject = Policy::parse(
            br#"{"default":[{"type":"insecureAcceptAnything"}],"transports":{"docker":{"reg.io/team":[{"type":"reject"}]}}}"#,
            "r",
        )
        .unwrap();
        let r = DockerRef::parse_normalized("reg.io/team/app:v1").unwrap();
        let s = Subject::docker(&r);
        let ok = accept.evaluate(&s, b"{}", &crate::policy::NoSignatures("")).unwrap();
        let e = Evidence::new(&s, b"{}", &[], &[], "none".into(), &ok);
        let e = Evidence::parse(&serde_json::to_vec(&e).unwrap()).unwrap();
        assert!(e.check(&accept).is_ok());
        let why = e.check(&reject).unwrap_err().to_string();
        assert!(
            why.contains("reg.io/team/app:v1") && why.contains("reg.io/team"),
            "{why}"
        );
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &[7; 32], &e).unwrap();
        assert_eq!(load(dir.path(), &[7; 32]).unwrap(), vec![e.clone()]);
        assert!(load(dir.path(), &[8; 32]).unwrap().is_empty());
        assert!(check_stored(dir.path(), &[8; 32], &accept)
            .unwrap_err()
            .to_string()
            .contains("no record"));
        assert!(check_stored(dir.path(), &[7; 32], &reject).is_err());
        // The same image under another name that the policy accepts.
        let r2 = DockerRef::parse_normalized("reg.io/other/app:v1").unwrap();
        let s2 = Subject::docker(&r2);
        let e2 = Evidence::new(&s2, b"{}", &[], &[], "none".into(), &ok);
        save(dir.path(), &[7; 32], &e2).unwrap();
        save(dir.path(), &[7; 32], &e2).unwrap();
        assert_eq!(load(dir.path(), &[7; 32]).unwrap(), vec![e2, e]);
        assert!(check_stored(dir.path(), &[7; 32], &reject).is_ok());
        assert!(Evidence::parse(b"{\"version\":1}").is_err());
    }
}
