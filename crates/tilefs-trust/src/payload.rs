//! The signed payload of a container signature (containers-signature(5)):
//! `{"critical": {"type", "image": {"docker-manifest-digest"}, "identity":
//! {"docker-reference"}}, "optional": {...}}`. Simple signing (OpenPGP)
//! uses the type `atomic container signature`, sigstore `cosign container
//! image signature`. Parsed strictly: the critical part may hold nothing
//! else, a member may not repeat; the optional part may hold anything (but
//! `creator` must be a string and `timestamp` an integer when present).

use crate::Error;
use serde_json::Value;

pub const SIMPLE_SIGNING_TYPE: &str = "atomic container signature";
pub const SIGSTORE_TYPE: &str = "cosign container image signature";

/// What a signature claims, once its cryptography has been checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub manifest_digest: String,
    pub docker_reference: String,
}

/// Refuses duplicated members anywhere in the document (serde_json keeps
/// the last silently).
pub(crate) fn check_json(raw: &[u8]) -> Result<(), serde_json::Error> {
    struct Checker;
    impl<'de> serde::de::Visitor<'de> for Checker {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(k) = map.next_key::<String>()? {
                if !seen.insert(k.clone()) {
                    return Err(serde::de::Error::custom(format!("member {k:?} appears twice")));
                }
                map.next_value::<Nested>()?;
            }
            Ok(())
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element::<Nested>()?.is_some() {}
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    }
    struct Nested;
    impl<'de> serde::Deserialize<'de> for Nested {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Nested, D::Error> {
            d.deserialize_any(Checker).map(|_| Nested)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(raw);
    serde::Deserializer::deserialize_any(&mut de, Checker)?;
    de.end()
}

fn object<'a>(v: &'a Value, what: &str, keys: &[&str]) -> Result<&'a serde_json::Map<String, Value>, Error> {
    let o = v
        .as_object()
        .ok_or_else(|| Error::Payload(format!("{what} is not an object")))?;
    for k in o.keys() {
        if !keys.contains(&k.as_str()) {
            return Err(Error::Payload(format!("{what} has an unknown member {k:?}")));
        }
    }
    for k in keys {
        if !o.contains_key(*k) {
            return Err(Error::Payload(format!("{what} lacks {k:?}")));
        }
    }
    Ok(o)
}

fn string<'a>(o: &'a serde_json::Map<String, Value>, k: &str, what: &str) -> Result<&'a str, Error> {
    o[k].as_str()
        .ok_or_else(|| Error::Payload(format!("{what}.{k} is not a string")))
}

/// Parses a payload of type `kind` (already authenticated).
pub fn parse(raw: &[u8], kind: &str) -> Result<Claim, Error> {
    check_json(raw).map_err(|e| Error::Payload(format!("the signed payload is not valid JSON: {e}")))?;
    let v: Value =
        serde_json::from_slice(raw).map_err(|e| Error::Payload(format!("the signed payload is not JSON: {e}")))?;
    let top = object(&v, "the payload", &["critical", "optional"])?;
    let critical = object(&top["critical"], "critical", &["type", "image", "identity"])?;
    let t = string(critical, "type", "critical")?;
    if t != kind {
        return Err(Error::Payload(format!("the payload's type is {t:?}, not {kind:?}")));
    }
    let image = object(&critical["image"], "critical.image", &["docker-manifest-digest"])?;
    let digest = string(image, "docker-manifest-digest", "critical.image")?;
    if !crate::dockerref::valid_digest(digest) {
        return Err(Error::Payload(format!(
            "critical.image.docker-manifest-digest {digest:?} is not a digest"
        )));
    }
    let identity = object(&critical["identity"], "critical.identity", &["docker-reference"])?;
    let reference = string(identity, "docker-reference", "critical.identity")?;
    // Sigstore signatures made by cosign may carry `"optional": null`.
    match &top["optional"] {
        Value::Null if kind == SIGSTORE_TYPE => {}
        Value::Object(o) => {
            if o.get("creator").is_some_and(|c| !c.is_string()) {
                return Err(Error::Payload("optional.creator is not a string".into()));
            }
            if o.get("timestamp").is_some_and(|t| !t.is_i64() && !t.is_u64()) {
                return Err(Error::Payload("optional.timestamp is not an integer".into()));
            }
        }
        _ => return Err(Error::Payload("optional is not an object".into())),
    }
    Ok(Claim {
        manifest_digest: digest.to_string(),
        docker_reference: reference.to_string(),
    })
}

/// A payload of type `kind` claiming `reference` for the manifest `digest`.
pub fn build(kind: &str, digest: &str, reference: &str) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let v = serde_json::json!({
        "critical": {
            "identity": {"docker-reference": reference},
            "image": {"docker-manifest-digest": digest},
            "type": kind,
        },
        "optional": {
            "creator": concat!("tilefs ", env!("CARGO_PKG_VERSION")),
            "timestamp": now,
        },
    });
    serde_json::to_vec(&v).expect("JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:817a12c32a39bbe394944ba49de563e085f1d3c5266eb8e9723256bc4448680e";

    #[test]
    fn round_trip_and_strictness() {
        let p = build(SIMPLE_SIGNING_TYPE, D, "docker.io/library/busybox:latest");
        let c = parse(&p, SIMPLE_SIGNING_TYPE).unwrap();
        assert_eq!(c.manifest_digest, D);
        assert!(parse(&p, SIGSTORE_TYPE).is_err());
        let ok = format!(
            r#"{{"critical":{{"type":"{SIGSTORE_TYPE}","image":{{"docker-manifest-digest":"{D}"}},"identity":{{"docker-reference":"x.io/a"}}}},"optional":null}}"#
        );
        assert!(parse(ok.as_bytes(), SIGSTORE_TYPE).is_ok());
        for bad in [
            ok.replace("\"optional\":null", "\"optional\":{},\"extra\":1"),
            ok.replace("\"identity\"", "\"identity2\""),
            ok.replace(r#""x.io/a"}"#, r#""x.io/a","more":1}"#),
            ok.replace(r#""type""#, r#""type":"x","type""#),
            ok.replace(D, "sha256:zz"),
            ok.replace("null", r#"{"timestamp":"now"}"#),
            "[]".to_string(),
            format!("{ok}x"),
        ] {
            assert!(parse(bad.as_bytes(), SIGSTORE_TYPE).is_err(), "{bad}");
        }
    }
}
