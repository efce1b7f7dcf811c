//! Simple signing with OpenPGP: a signature is an OpenPGP signed message
//! (RFC 4880 section 11.3) whose literal data is the JSON payload.
//!
//! Verification uses sequoia-openpgp under its standard policy: the message
//! must be a signed message, signed by a key of the policy's keyring that
//! was valid (bound, not revoked, not expired, signing-capable) when it
//! signed, and the signature must be alive now; the payload is returned
//! only once all of it has been authenticated.
//!
//! Signing is GnuPG's own (`gpg --sign`), with the key from the user's
//! keyring (`$GNUPGHOME`), as podman and skopeo sign through gpgme.

use crate::Error;
use openpgp::cert::prelude::*;
use openpgp::parse::stream::{MessageLayer, MessageStructure, VerificationHelper, VerifierBuilder};
use openpgp::parse::Parse;
use openpgp::policy::StandardPolicy;
use openpgp::{Cert, KeyHandle};
use sequoia_openpgp as openpgp;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

/// The largest signature read (a payload is a few hundred bytes).
pub const MAX_SIGNATURE: usize = 4 << 20;

/// Parses a keyring (binary or ASCII-armored, one or more certificates).
pub fn parse_keyring(data: &[u8]) -> Result<Vec<Cert>, Error> {
    let mut certs = Vec::new();
    for c in CertParser::from_bytes(data).map_err(|e| Error::Key(format!("not an OpenPGP keyring: {e}")))? {
        certs.push(c.map_err(|e| Error::Key(format!("not an OpenPGP keyring: {e}")))?);
    }
    if certs.is_empty() {
        return Err(Error::Key("the keyring holds no key".into()));
    }
    Ok(certs)
}

struct Helper<'a> {
    certs: &'a [Cert],
    /// The fingerprint of the key whose signature checked out.
    signer: Option<String>,
    /// Why no signature did.
    failures: Vec<String>,
}

impl VerificationHelper for Helper<'_> {
    fn get_certs(&mut self, _ids: &[KeyHandle]) -> openpgp::Result<Vec<Cert>> {
        Ok(self.certs.to_vec())
    }

    fn check(&mut self, structure: MessageStructure) -> openpgp::Result<()> {
        for layer in structure.into_iter() {
            match layer {
                MessageLayer::Compression { .. } => {}
                MessageLayer::Encryption { .. } => {
                    self.failures.push("the signature is an encrypted message".into());
                }
                MessageLayer::SignatureGroup { results } => {
                    for r in results {
                        match r {
                            Ok(good) => {
                                self.signer.get_or_insert(good.ka.cert().fingerprint().to_hex());
                            }
                            Err(e) => self.failures.push(describe(&e)),
                        }
                    }
                }
            }
        }
        if self.signer.is_some() {
            Ok(())
        } else {
            if self.failures.is_empty() {
                self.failures.push("it is not signed".into());
            }
            Err(anyhow_error(self.failures.join("; ")))
        }
    }
}

fn anyhow_error(msg: String) -> openpgp::anyhow::Error {
    openpgp::anyhow::anyhow!(msg)
}

fn describe(e: &openpgp::parse::stream::VerificationError) -> String {
    use openpgp::parse::stream::VerificationError as V;
    let issuers = |sig: &openpgp::packet::Signature| {
        sig.get_issuers()
            .iter()
            .map(|h| h.to_hex())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match e {
        V::MissingKey { sig } => format!("signed by key {} which the policy does not list", issuers(sig)),
        V::UnboundKey { sig, error, .. } => format!("key {} is not valid: {error}", issuers(sig)),
        V::BadKey { sig, error, .. } => format!("key {} is not usable: {error}", issuers(sig)),
        V::BadSignature { sig, error, .. } => {
            format!("the signature by key {} does not verify: {error}", issuers(sig))
        }
        V::MalformedSignature { error, .. } => format!("malformed signature: {error}"),
        other => format!("unusable signature: {other}"),
    }
}

/// Verifies the signed message `sig` against `certs`: the authenticated
/// payload and the signing certificate's fingerprint.
pub fn verify(certs: &[Cert], sig: &[u8]) -> Result<(Vec<u8>, String), Error> {
    let policy = StandardPolicy::new();
    let helper = Helper {
        certs,
        signer: None,
        failures: Vec::new(),
    };
    let mut v = VerifierBuilder::from_bytes(sig)
        .map_err(|e| Error::Signature(format!("not an OpenPGP message: {e}")))?
        .with_policy(&policy, None, helper)
        .map_err(|e| Error::Signature(first_line(&e)))?;
    let mut payload = Vec::new();
    (&mut v)
        .take(MAX_SIGNATURE as u64 + 1)
        .read_to_end(&mut payload)
        .map_err(|e| Error::Signature(e.to_string()))?;
    if payload.len() > MAX_SIGNATURE {
        return Err(Error::Signature("the signed payload is too large".into()));
    }
    if !v.message_processed() {
        return Err(Error::Signature("the message was not read to its end".into()));
    }
    let signer = v
        .into_helper()
        .signer
        .ok_or_else(|| Error::Signature("no valid signature".into()))?;
    Ok((payload, signer))
}

fn first_line(e: &openpgp::anyhow::Error) -> String {
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

/// Signs `payload` with the GnuPG key `fingerprint` (binary signed message,
/// as gpgme makes). `passphrase_file`, when given, unlocks the key without
/// a prompt.
pub fn sign(payload: &[u8], fingerprint: &str, passphrase_file: Option<&Path>) -> Result<Vec<u8>, Error> {
    let mut cmd = Command::new("gpg");
    cmd.args([
        "--batch",
        "--no-tty",
        "--status-fd",
        "2",
        "--sign",
        "--local-user",
        fingerprint,
    ]);
    if let Some(p) = passphrase_file {
        cmd.args(["--pinentry-mode", "loopback", "--passphrase-file"]).arg(p);
    }
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| Error::Sign(format!("cannot run gpg: {e}")))?;
    let mut stdin = child.stdin.take().expect("piped");
    let data = payload.to_vec();
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &data));
    let out = child.wait_with_output().map_err(|e| Error::Sign(format!("gpg: {e}")))?;
    let _ = writer.join();
    if !out.status.success() || out.stdout.is_empty() {
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("[GNUPG:]")).collect();
        return Err(Error::Sign(format!(
            "gpg could not sign with key {fingerprint}: {}",
            lines.join("; ")
        )));
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use openpgp::serialize::stream::{LiteralWriter, Message, Signer};
    use std::io::Write;

    fn signed(cert: &Cert, payload: &[u8]) -> Vec<u8> {
        let p = StandardPolicy::new();
        let key = cert
            .keys()
            .unencrypted_secret()
            .with_policy(&p, None)
            .supported()
            .alive()
            .revoked(false)
            .for_signing()
            .next()
            .unwrap()
            .key()
            .clone()
            .into_keypair()
            .unwrap();
        let mut out = Vec::new();
        let m = Message::new(&mut out);
        let m = Signer::new(m, key).unwrap().build().unwrap();
        let mut w = LiteralWriter::new(m).build().unwrap();
        w.write_all(payload).unwrap();
        w.finalize().unwrap();
        out
    }

    #[test]
    fn signed_messages_verify_only_with_their_key() {
        let (alice, _) = CertBuilder::general_purpose(Some("alice@example.org"))
            .generate()
            .unwrap();
        let (bob, _) = CertBuilder::general_purpose(Some("bob@example.org"))
            .generate()
            .unwrap();
        let msg = signed(&alice, b"{\"x\":1}");
        let (payload, fpr) = verify(std::slice::from_ref(&alice), &msg).unwrap();
        assert_eq!(payload, b"{\"x\":1}");
        assert_eq!(fpr, alice.fingerprint().to_hex());
        let e = verify(std::slice::from_ref(&bob), &msg).unwrap_err();
        assert!(e.to_string().contains("does not list"), "{e}");
        let mut bad = msg.clone();
        let n = bad.len();
        bad[n - 10] ^= 1;
        assert!(verify(std::slice::from_ref(&alice), &bad).is_err());
        assert!(verify(std::slice::from_ref(&alice), b"garbage").is_err());
        // A literal message without a signature is not a signed message.
        let mut lit = Vec::new();
        let mut w = LiteralWriter::new(Message::new(&mut lit)).build().unwrap();
        w.write_all(b"{}").unwrap();
        w.finalize().unwrap();
        assert!(verify(std::slice::from_ref(&alice), &lit).is_err());
    }
}
