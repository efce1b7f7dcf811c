//! Sigstore signatures with public keys, as cosign and containers/image
//! store them: the payload (a container signature of type `cosign
//! container image signature`) is a layer of an OCI image manifest tagged
//! `sha256-HEX.sig` in the image's repository, its media type
//! `application/vnd.dev.cosign.simplesigning.v1+json`, the signature (ECDSA
//! P-256 over the SHA-256 of the payload, ASN.1 DER, base64) in its
//! annotation `dev.cosignproject.cosign/signature`.
//!
//! Private keys are cosign's encrypted PEM files (`ENCRYPTED SIGSTORE
//! PRIVATE KEY` or `ENCRYPTED COSIGN PRIVATE KEY`): a JSON envelope
//! (secure-systems-lab's format: scrypt key derivation, NaCl secretbox)
//! around the key's PKCS#8 DER. Public keys are PEM `PUBLIC KEY` (SPKI).

use crate::Error;
use base64::Engine;
use crypto_secretbox::aead::{Aead, KeyInit};
use p256::ecdsa::signature::{Signer as _, Verifier as _};
use p256::ecdsa::Signature;
pub use p256::ecdsa::{SigningKey, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey, LineEnding};
use serde::{Deserialize, Serialize};

pub const SIGNATURE_LAYER_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
const SIGSTORE_PEM: &str = "ENCRYPTED SIGSTORE PRIVATE KEY";
const COSIGN_PEM: &str = "ENCRYPTED COSIGN PRIVATE KEY";
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// One signature as found in the registry: the payload layer's bytes and
/// the annotation's base64 signature.
#[derive(Debug, Clone)]
pub struct SigstoreSignature {
    pub payload: Vec<u8>,
    pub signature: String,
}

/// The tag of the attachments of the manifest `digest` (`sha256:HEX` ->
/// `sha256-HEX.sig`).
pub fn signature_tag(digest: &str) -> String {
    format!("{}.sig", digest.replacen(':', "-", 1))
}

/// A public key from its PEM text (P-256 ECDSA keys, as cosign makes).
pub fn parse_public_key(pem: &[u8]) -> Result<VerifyingKey, Error> {
    let text = std::str::from_utf8(pem).map_err(|_| Error::Key("a public key file is PEM text".into()))?;
    VerifyingKey::from_public_key_pem(text.trim()).map_err(|e| {
        Error::Key(format!(
            "not a PEM public key of ECDSA P-256 (the only kind tilefs verifies sigstore signatures with): {e}"
        ))
    })
}

/// Checks `sig` over `payload` with `key`.
pub fn verify(key: &VerifyingKey, sig: &SigstoreSignature) -> Result<(), Error> {
    let raw = B64
        .decode(sig.signature.trim())
        .map_err(|_| Error::Signature("the signature annotation is not base64".into()))?;
    let s = Signature::from_der(&raw)
        .map_err(|_| Error::Signature("the signature is not an ASN.1 ECDSA signature".into()))?;
    key.verify(&sig.payload, &s)
        .map_err(|_| Error::Signature("the signature does not verify with the policy's public key".into()))
}

/// Signs `payload`: the base64 signature for the annotation.
pub fn sign(key: &SigningKey, payload: &[u8]) -> String {
    let s: Signature = key.sign(payload);
    B64.encode(s.to_der().as_bytes())
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    kdf: Kdf,
    cipher: Cipher,
    ciphertext: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Kdf {
    name: String,
    params: KdfParams,
    salt: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KdfParams {
    #[serde(rename = "N")]
    n: u64,
    r: u32,
    p: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Cipher {
    name: String,
    nonce: String,
}

fn derive(pass: &[u8], salt: &[u8], n: u64, r: u32, p: u32) -> Result<[u8; 32], Error> {
    if !n.is_power_of_two() || !(2..=1 << 20).contains(&n) || !(1..=32).contains(&r) || !(1..=16).contains(&p) {
        return Err(Error::Key(format!("unsupported scrypt parameters N={n} r={r} p={p}")));
    }
    let params = scrypt::Params::new(n.trailing_zeros() as u8, r, p, 32).map_err(|e| Error::Key(e.to_string()))?;
    let mut key = [0u8; 32];
    scrypt::scrypt(pass, salt, &params, &mut key).map_err(|e| Error::Key(e.to_string()))?;
    Ok(key)
}

/// Decrypts a cosign private key file with `passphrase`.
pub fn parse_private_key(pem: &[u8], passphrase: &[u8]) -> Result<SigningKey, Error> {
    let text = std::str::from_utf8(pem).map_err(|_| Error::Key("a private key file is PEM text".into()))?;
    let (label, body) = p256::pkcs8::der::pem::decode_vec(text.trim().as_bytes())
        .map_err(|e| Error::Key(format!("not a PEM file: {e}")))?;
    if label != SIGSTORE_PEM && label != COSIGN_PEM {
        return Err(Error::Key(format!(
            "a PEM block {label:?}, not an encrypted sigstore private key ({SIGSTORE_PEM})"
        )));
    }
    let env: Envelope =
        serde_json::from_slice(&body).map_err(|e| Error::Key(format!("not an encrypted sigstore private key: {e}")))?;
    if env.kdf.name != "scrypt" || env.cipher.name != "nacl/secretbox" {
        return Err(Error::Key(format!(
            "unsupported key encryption {} / {} (scrypt and nacl/secretbox are)",
            env.kdf.name, env.cipher.name
        )));
    }
    let salt = B64
        .decode(&env.kdf.salt)
        .map_err(|_| Error::Key("the salt is not base64".into()))?;
    let nonce = B64
        .decode(&env.cipher.nonce)
        .map_err(|_| Error::Key("the nonce is not base64".into()))?;
    let ct = B64
        .decode(&env.ciphertext)
        .map_err(|_| Error::Key("the ciphertext is not base64".into()))?;
    if nonce.len() != 24 {
        return Err(Error::Key("the nonce is not 24 bytes".into()));
    }
    let key = derive(passphrase, &salt, env.kdf.params.n, env.kdf.params.r, env.kdf.params.p)?;
    let sb = crypto_secretbox::XSalsa20Poly1305::new(&key.into());
    let der = sb
        .decrypt(crypto_secretbox::Nonce::from_slice(&nonce), ct.as_slice())
        .map_err(|_| Error::Key("wrong passphrase (or a damaged key file)".into()))?;
    SigningKey::from_pkcs8_der(&der)
        .map_err(|e| Error::Key(format!("the decrypted key is not a P-256 PKCS#8 key: {e}")))
}

/// A new key pair: the encrypted private key and the public key, as PEM.
pub fn generate(passphrase: &[u8]) -> Result<(String, String), Error> {
    let key = loop {
        let mut b = [0u8; 32];
        getrandom::getrandom(&mut b).map_err(|e| Error::Sign(format!("no randomness: {e}")))?;
        if let Ok(k) = SigningKey::from_slice(&b) {
            break k;
        }
    };
    let der = key.to_pkcs8_der().map_err(|e| Error::Sign(e.to_string()))?;
    let mut salt = [0u8; 32];
    let mut nonce = [0u8; 24];
    getrandom::getrandom(&mut salt).map_err(|e| Error::Sign(format!("no randomness: {e}")))?;
    getrandom::getrandom(&mut nonce).map_err(|e| Error::Sign(format!("no randomness: {e}")))?;
    let (n, r, p) = (32768, 8, 1);
    let k = derive(passphrase, &salt, n, r, p)?;
    let sb = crypto_secretbox::XSalsa20Poly1305::new(&k.into());
    let ct = sb
        .encrypt(crypto_secretbox::Nonce::from_slice(&nonce), der.as_bytes())
        .map_err(|_| Error::Sign("cannot encrypt".into()))?;
    let env = Envelope {
        kdf: Kdf {
            name: "scrypt".into(),
            params: KdfParams { n, r, p },
            salt: B64.encode(salt),
        },
        cipher: Cipher {
            name: "nacl/secretbox".into(),
            nonce: B64.encode(nonce),
        },
        ciphertext: B64.encode(ct),
    };
    let body = serde_json::to_vec(&env).map_err(|e| Error::Sign(e.to_string()))?;
    let private = p256::pkcs8::der::pem::encode_string(SIGSTORE_PEM, LineEnding::LF, &body)
        .map_err(|e| Error::Sign(e.to_string()))?;
    let public = key
        .verifying_key()
        .to_public_key_pem(LineEnding::LF)
        .map_err(|e| Error::Sign(e.to_string()))?;
    Ok((private, public))
}

/// A descriptor of the attachment manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub size: u64,
    pub digest: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
}

/// The attachment manifest's parts tilefs reads and writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachmentManifest {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

/// The signature layers of an attachment manifest: their descriptors and
/// signatures (the payloads are blobs to fetch and check by digest).
pub fn signature_layers(m: &AttachmentManifest) -> Vec<(Descriptor, String)> {
    m.layers
        .iter()
        .filter(|l| l.media_type == SIGNATURE_LAYER_TYPE)
        .filter_map(|l| {
            let sig = l.annotations.as_ref()?.get(SIGNATURE_ANNOTATION)?.clone();
            Some((l.clone(), sig))
        })
        .collect()
}

/// The image configuration of an attachment manifest whose layers are
/// `payloads` (their digests, in order).
pub fn attachment_config(payload_digests: &[String]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": "",
        "os": "",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": payload_digests},
    }))
    .expect("JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_sign() {
        let (private, public) = generate(b"pw").unwrap();
        assert!(private.starts_with("-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----"));
        let k = parse_private_key(private.as_bytes(), b"pw").unwrap();
        assert!(parse_private_key(private.as_bytes(), b"wrong").is_err());
        let v = parse_public_key(public.as_bytes()).unwrap();
        let payload = b"{\"a\":1}".to_vec();
        let sig = SigstoreSignature {
            signature: sign(&k, &payload),
            payload: payload.clone(),
        };
        verify(&v, &sig).unwrap();
        let mut other = sig.clone();
        other.payload[2] ^= 1;
        assert!(verify(&v, &other).is_err());
        let (_, public2) = generate(b"").unwrap();
        assert!(verify(&parse_public_key(public2.as_bytes()).unwrap(), &sig).is_err());
        assert_eq!(signature_tag("sha256:abcd"), "sha256-abcd.sig");
    }
}
