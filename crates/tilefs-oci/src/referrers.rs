//! Artifacts that refer to an image (OCI distribution spec 1.1): pushed
//! with a `subject`, listed by the registry's referrers API
//! (`GET /v2/NAME/referrers/DIGEST`), or, where a registry has none (as
//! distribution 2.8), by the fallback tag `sha256-HEX` of the subject: an
//! OCI image index whose `manifests` are the referrers, kept by every
//! client that pushes one (read, add, write back, others' entries kept).

use crate::digest::Digest;
use crate::manifest::{OCI_INDEX, OCI_MANIFEST};
use crate::transport::registry::Registry;
use crate::OciError;
use serde_json::{json, Value};

/// Most referrers kept in one list (a fallback tag's index is a manifest:
/// [`crate::bounded::MAX_MANIFEST`] bounds its bytes anyway).
pub const MAX_REFERRERS: usize = 4096;

/// One referrer as a list names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Referrer {
    pub digest: Digest,
    pub size: u64,
    pub artifact_type: String,
}

/// The fallback tag of `subject`: `ALG-HEX`.
pub fn fallback_tag(subject: &Digest) -> String {
    format!("{}-{}", subject.algorithm(), subject.hex())
}

/// The referrers an index (from the API or a fallback tag) lists with an
/// artifact type of `types`, in its order (the last one pushed last).
/// Entries of other types, or that are not manifests, are skipped; an
/// index that is not one is an error. `types` is the manifest's
/// `artifactType` and its configuration's media type: registries that
/// followed the spec's release candidates (go-containerregistry's) list a
/// referrer under the latter even when the manifest names the former. The
/// caller checks the manifest it then fetches.
pub fn parse_list(bytes: &[u8], types: &[&str]) -> Result<Vec<Referrer>, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let manifests = manifests_of(&v)?;
    let mut out = Vec::new();
    for m in manifests {
        let Some(artifact_type) = m
            .get("artifactType")
            .and_then(Value::as_str)
            .filter(|t| types.contains(t))
        else {
            continue;
        };
        if m.get("mediaType").and_then(Value::as_str) != Some(OCI_MANIFEST) {
            continue;
        }
        let digest = m
            .get("digest")
            .and_then(Value::as_str)
            .ok_or("a referrer without a digest")?;
        let digest = Digest::parse(digest).map_err(|e| format!("a referrer's digest: {e}"))?;
        let size = m
            .get("size")
            .and_then(Value::as_u64)
            .ok_or("a referrer without a size")?;
        out.push(Referrer {
            digest,
            size,
            artifact_type: artifact_type.to_string(),
        });
    }
    Ok(out)
}

/// The `manifests` of an OCI image index.
fn manifests_of(v: &Value) -> Result<&Vec<Value>, String> {
    if v.get("schemaVersion").and_then(Value::as_u64) != Some(2) {
        return Err("not an image index (schemaVersion is not 2)".into());
    }
    if let Some(t) = v.get("mediaType").and_then(Value::as_str) {
        if t != OCI_INDEX {
            return Err(format!("not an OCI image index (media type {t})"));
        }
    }
    let list = v
        .get("manifests")
        .and_then(Value::as_array)
        .ok_or("an image index without manifests")?;
    if list.len() > MAX_REFERRERS {
        return Err(format!("lists {} referrers, more than {MAX_REFERRERS}", list.len()));
    }
    Ok(list)
}

/// The fallback index `existing` (None: there is none yet) with
/// `entry` (a descriptor) added: every other entry kept as it was, an
/// entry of the same digest replaced.
pub fn add_to_list(existing: Option<&[u8]>, entry: Value) -> Result<Vec<u8>, String> {
    let mut list: Vec<Value> = match existing {
        Some(b) => {
            let v: Value = serde_json::from_slice(b).map_err(|e| format!("not JSON: {e}"))?;
            manifests_of(&v)?.clone()
        }
        None => Vec::new(),
    };
    let digest = entry.get("digest").cloned();
    list.retain(|m| m.get("digest") != digest.as_ref());
    if list.len() >= MAX_REFERRERS {
        return Err(format!("already lists {MAX_REFERRERS} referrers"));
    }
    list.push(entry);
    let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list});
    Ok(serde_json::to_vec(&index).expect("an index serializes"))
}

/// How a referrer got listed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Listed {
    /// The registry lists it itself (it has the referrers API).
    pub referrers_api: bool,
    /// The fallback tag that lists it, where the registry does not.
    pub fallback_tag: Option<String>,
}

/// Pushes `manifest` (an OCI image manifest of artifact type `types[0]`,
/// configuration type `types[1]`, whose `subject` is `subject`) by digest
/// and makes sure it is listed: by the
/// registry's referrers API, else in the fallback tag. The API is asked
/// rather than the PUT's `OCI-Subject` header read (which the client
/// library does not hand back): a registry that lists the new manifest has
/// the API, whatever its headers.
pub fn push(
    reg: &Registry,
    subject: &Digest,
    manifest: Vec<u8>,
    types: &[&str],
    annotations: Value,
) -> Result<Listed, OciError> {
    let artifact_type = types[0];
    let digest = Digest::sha256_of(&manifest);
    let size = manifest.len() as u64;
    reg.put_manifest_by_digest(&digest, manifest, OCI_MANIFEST)?;
    if let Ok(Some(list)) = reg.referrers(subject, artifact_type) {
        if parse_list(&list, types).is_ok_and(|l| l.iter().any(|r| r.digest == digest)) {
            return Ok(Listed {
                referrers_api: true,
                fallback_tag: None,
            });
        }
    }
    let tag = fallback_tag(subject);
    let entry = json!({
        "mediaType": OCI_MANIFEST,
        "digest": digest.to_string(),
        "size": size,
        "artifactType": artifact_type,
        "annotations": annotations,
    });
    // Read, add, write; read again: another client writing at the same
    // time may have dropped our entry (the spec's scheme has no lock).
    for _ in 0..3 {
        let existing = reg.manifest_at(&tag)?;
        let what = format!("the referrers list {tag}");
        let list = add_to_list(existing.as_deref(), entry.clone()).map_err(|e| OciError::manifest(&what, e))?;
        reg.put_manifest_at(&tag, list, OCI_INDEX)?;
        let now = reg.manifest_at(&tag)?.unwrap_or_default();
        if parse_list(&now, types).is_ok_and(|l| l.iter().any(|r| r.digest == digest)) {
            return Ok(Listed {
                referrers_api: false,
                fallback_tag: Some(tag),
            });
        }
    }
    Err(OciError::manifest(
        format!("the referrers list {tag}"),
        "another client kept replacing it: our entry did not stay",
    ))
}

/// The referrers of `subject` with an artifact type of `types` (see
/// [`parse_list`]; the first is asked for): from the referrers API, or
/// where the registry has none (404, or an answer that is not a list),
/// from the fallback tag; empty when neither lists any.
pub fn find(reg: &Registry, subject: &Digest, types: &[&str]) -> Result<Vec<Referrer>, OciError> {
    if let Ok(Some(list)) = reg.referrers(subject, types[0]) {
        if let Ok(found) = parse_list(&list, types) {
            return Ok(found);
        }
    }
    let tag = fallback_tag(subject);
    match reg.manifest_at(&tag)? {
        None => Ok(Vec::new()),
        Some(bytes) => {
            parse_list(&bytes, types).map_err(|e| OciError::manifest(format!("the referrers list {tag}"), e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn others_entries_are_kept_and_ours_replaced() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let other = json!({"mediaType": OCI_MANIFEST, "digest": d('a'), "size": 3, "artifactType": "x/other", "annotations": {"k": "v"}});
        let first = add_to_list(None, other.clone()).unwrap();
        let ours = json!({"mediaType": OCI_MANIFEST, "digest": d('b'), "size": 5, "artifactType": "x/ours"});
        let two = add_to_list(Some(&first), ours.clone()).unwrap();
        let again = add_to_list(Some(&two), ours).unwrap();
        assert_eq!(two, again);
        let v: Value = serde_json::from_slice(&again).unwrap();
        assert_eq!(v["manifests"][0], other);
        assert_eq!(parse_list(&again, &["x/ours"]).unwrap().len(), 1);
        assert_eq!(parse_list(&again, &["x/other"]).unwrap()[0].size, 3);
        assert_eq!(
            parse_list(&again, &["x/none", "x/other"]).unwrap()[0].artifact_type,
            "x/other"
        );
        assert!(add_to_list(Some(b"{}"), json!({})).is_err());
        assert!(parse_list(br#"{"schemaVersion":2,"mediaType":"x","manifests":[]}"#, &["x"]).is_err());
    }
}
