//! Signature policy, signing and registries.conf against the real tools:
//! Debian's skopeo (1.9.3) signs images with a GnuPG key the test makes
//! and with a sigstore key (`--sign-by-sigstore-private-key`), tilefs
//! pulls them under policies that accept or refuse them; tilefs signs its
//! pushes and skopeo checks them under the same policies; registries.conf
//! routes pulls through mirrors, refuses blocked registries and resolves
//! short names; a lazy pull uses an ordinary image's index only where the
//! policy accepts the index's own signature. Nothing reads the machine's
//! /etc/containers: every command gets its policy, registries.d and
//! registries.conf from the test, and HOME points into the test's
//! directory.

mod common;

use common::registry::{Answer, Registry, Relay};
use common::*;
use sha2::Digest as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The test's configuration: a home, a GnuPG home, keys, registries.d.
struct Env {
    area: Area,
    home: PathBuf,
    gnupg: PathBuf,
    sigs: PathBuf,
    regd: PathBuf,
    conf: PathBuf,
}

impl Env {
    fn new() -> Env {
        let area = Area::new();
        let home = area.dir("home");
        let gnupg = area.dir("gnupg");
        fs::set_permissions(&gnupg, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        let sigs = area.dir("sigs");
        let regd = area.dir("registries.d");
        let conf = area.path("registries.conf");
        fs::write(&conf, "").unwrap();
        Env {
            area,
            home,
            gnupg,
            sigs,
            regd,
            conf,
        }
    }

    /// registries.d for the registry at `addr`: lookaside in `sigs`,
    /// sigstore attachments on.
    fn registries_d(&self, addrs: &[&str]) {
        let mut y = String::from("docker:\n");
        for a in addrs {
            y.push_str(&format!(
                "  {a}:\n    lookaside: file://{}\n    use-sigstore-attachments: true\n",
                self.sigs.display()
            ));
        }
        fs::write(self.regd.join("test.yaml"), y).unwrap();
    }

    /// A new GnuPG key: its fingerprint and its exported public key file.
    fn gpg_key(&self, name: &str) -> (String, PathBuf) {
        let out = self.gpg(&[
            "--passphrase",
            "",
            "--quick-gen-key",
            &format!("{name} <{name}@example.org>"),
            "ed25519",
            "sign",
            "never",
        ]);
        assert!(out.status.success(), "gpg: {}", String::from_utf8_lossy(&out.stderr));
        let list = self.gpg(&["--with-colons", "--list-keys", &format!("{name}@example.org")]);
        let text = String::from_utf8_lossy(&list.stdout).into_owned();
        let fpr = text
            .lines()
            .find(|l| l.starts_with("fpr:"))
            .and_then(|l| l.split(':').nth(9))
            .unwrap()
            .to_string();
        let export = self.gpg(&["--export", &fpr]);
        let path = self.area.path(&format!("{name}.gpg"));
        fs::write(&path, &export.stdout).unwrap();
        (fpr, path)
    }

    fn gpg(&self, args: &[&str]) -> Output {
        Command::new("gpg")
            .env("GNUPGHOME", &self.gnupg)
            .args(["--batch", "--pinentry-mode", "loopback"])
            .args(args)
            .output()
            .expect("gpg (scripts/setup installs gnupg)")
    }

    /// A sigstore key pair written by tilefs: (private, public).
    fn sigstore_key(&self, name: &str) -> (PathBuf, PathBuf) {
        let prefix = self.area.path(name);
        let pw = self.area.path("passphrase");
        fs::write(&pw, "secret\n").unwrap();
        self.tilefs_ok(&[
            "generate-sigstore-key",
            "--output-prefix",
            prefix.to_str().unwrap(),
            "--passphrase-file",
            pw.to_str().unwrap(),
        ]);
        (prefix.with_extension("key"), prefix.with_extension("pub"))
    }

    fn policy(&self, name: &str, json: &str) -> PathBuf {
        let p = self.area.path(name);
        fs::write(&p, json).unwrap();
        p
    }

    fn cmd(&self, program: &Path) -> Command {
        let mut c = Command::new(program);
        c.env("HOME", &self.home)
            .env("GNUPGHOME", &self.gnupg)
            .env_remove("CONTAINERS_REGISTRIES_CONF")
            .env_remove("REGISTRIES_CONFIG_PATH");
        c
    }

    fn tilefs(&self, args: &[&str]) -> Output {
        self.cmd(&tilefs_bin()).args(args).output().unwrap()
    }

    fn tilefs_ok(&self, args: &[&str]) -> Output {
        let out = self.tilefs(args);
        assert!(
            out.status.success(),
            "tilefs {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// `tilefs pull` into `store` with `policy`: Ok(digest) or Err(stderr).
    fn pull(&self, store: &Path, reference: &str, policy: &Path, extra: &[&str]) -> Result<String, String> {
        let mut args = vec![
            "pull",
            "-q",
            "--store",
            store.to_str().unwrap(),
            "--signature-policy",
            policy.to_str().unwrap(),
            "--registries.d",
            self.regd.to_str().unwrap(),
            "--registries-conf",
            self.conf.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        args.push(reference);
        let out = self.tilefs(&args);
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// skopeo with the test's registries.d (and `policy`, or none at all).
    fn skopeo(&self, policy: Option<&Path>, args: &[&str]) -> Output {
        let mut c = self.cmd(Path::new("skopeo"));
        c.arg("--registries.d").arg(&self.regd);
        match policy {
            Some(p) => c.arg("--policy").arg(p),
            None => c.arg("--insecure-policy"),
        };
        c.args(args).output().expect("skopeo (scripts/setup installs it)")
    }

    fn skopeo_ok(&self, policy: Option<&Path>, args: &[&str]) -> Output {
        let out = self.skopeo(policy, args);
        assert!(
            out.status.success(),
            "skopeo {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

fn accept_anything() -> &'static str {
    r#"{"default":[{"type":"insecureAcceptAnything"}]}"#
}

fn signed_by(key: &Path, identity: &str) -> String {
    format!(
        r#"{{"default":[{{"type":"reject"}}],"transports":{{"docker":{{"":[{{"type":"signedBy","keyType":"GPGKeys","keyPath":"{}"{identity}}}]}}}}}}"#,
        key.display()
    )
}

fn sigstore_signed(key: &Path, identity: &str) -> String {
    format!(
        r#"{{"default":[{{"type":"reject"}}],"transports":{{"docker":{{"":[{{"type":"sigstoreSigned","keyPath":"{}"{identity}}}]}}}}}}"#,
        key.display()
    )
}

fn tagged(store: &Path) -> Vec<String> {
    fs::read_dir(store.join("images"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn lookaside_dir(env: &Env, repo: &str, digest: &str) -> PathBuf {
    env.sigs.join(format!("{repo}@{}", digest.replacen(':', "=", 1)))
}

fn manifest_digest(env: &Env, remote: &str) -> String {
    let out = env.skopeo_ok(None, &["inspect", "--tls-verify=false", "--raw", remote]);
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(&out.stdout)))
}

#[test]
fn images_skopeo_signed_are_pulled_or_refused_by_the_policy() {
    let env = Env::new();
    let registry = Registry::start(&env.area);
    let addr = registry.addr.clone();
    env.registries_d(&[&addr]);
    let (fpr, key) = env.gpg_key("alice");
    let (_, other_key) = env.gpg_key("mallory");
    let (sig_priv, sig_pub) = env.sigstore_key("cosign");
    let (_, other_pub) = env.sigstore_key("other");
    let layout = env.area.dir("layout");
    oci_layout(&layout, "a", "first image");
    oci_layout(&env.area.dir("layout2"), "b", "second image");
    let src = format!("oci:{}:a", layout.display());

    // skopeo 1.9.3 signs: simple signing into the lookaside, sigstore as an
    // attachment.
    let gpg_ref = format!("docker://{addr}/signed/gpg:v1");
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            "--sign-by",
            &fpr,
            &src,
            &gpg_ref,
        ],
    );
    // skopeo signs with the sigstore key too (the key file tilefs wrote,
    // its passphrase from a file) where its build has sigstore: Debian's
    // 1.9.3 answers "Debian-local change: sigstore disabled", and then
    // tilefs's own sigstore signatures, checked by openssl in the next
    // test, stand in for it.
    let sig_ref = format!("docker://{addr}/signed/sigstore:v1");
    let out = env.skopeo(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            "--sign-by-sigstore-private-key",
            sig_priv.to_str().unwrap(),
            "--sign-passphrase-file",
            env.area.path("passphrase").to_str().unwrap(),
            &src,
            &sig_ref,
        ],
    );
    let skopeo_sigstore = out.status.success();
    eprintln!(
        "skopeo --sign-by-sigstore-private-key: {}",
        if skopeo_sigstore {
            "signs".to_string()
        } else {
            String::from_utf8_lossy(&out.stderr).trim().to_string()
        }
    );
    let plain_ref = format!("docker://{addr}/plain/app:v1");
    env.skopeo_ok(None, &["copy", "-q", "--dest-tls-verify=false", &src, &plain_ref]);
    let flags = ["--tls-verify=false"];

    let accept = env.policy("accept.json", accept_anything());
    let gpg_ok = env.policy("gpg.json", &signed_by(&key, ""));
    let gpg_other = env.policy("gpg-other.json", &signed_by(&other_key, ""));
    let gpg_identity = env.policy(
        "gpg-identity.json",
        &signed_by(
            &key,
            r#","signedIdentity":{"type":"exactReference","dockerReference":"quay.io/else/where:v1"}"#,
        ),
    );
    let gpg_remap = env.policy(
        "gpg-remap.json",
        &signed_by(
            &key,
            &format!(r#","signedIdentity":{{"type":"remapIdentity","prefix":"{addr}/mirrored","signedPrefix":"{addr}/signed"}}"#),
        ),
    );
    let sig_ok = env.policy("sig.json", &sigstore_signed(&sig_pub, ""));
    let sig_other = env.policy("sig-other.json", &sigstore_signed(&other_pub, ""));
    let reject = env.policy(
        "reject.json",
        &format!(
            r#"{{"default":[{{"type":"insecureAcceptAnything"}}],"transports":{{"docker":{{"{addr}/signed":[{{"type":"reject"}}]}}}}}}"#
        ),
    );

    let store = env.area.path("store");
    // Accepted.
    env.pull(&store, &gpg_ref, &gpg_ok, &flags).unwrap();
    env.pull(&store, &plain_ref, &accept, &flags).unwrap();
    assert_eq!(tagged(&store).len(), 2);
    // The image (the same for both names) keeps the record of each check
    // (with the signature that passed, for the mount service to judge
    // again); fsck knows the records.
    let records: Vec<serde_json::Value> = fs::read_dir(store.join(".trust"))
        .unwrap()
        .map(|e| serde_json::from_slice(&fs::read(e.unwrap().path()).unwrap()).unwrap())
        .collect();
    assert_eq!(records.len(), 1);
    let checks = records[0].as_array().unwrap();
    assert_eq!(checks.len(), 2, "{checks:?}");
    assert!(
        checks.iter().any(|r| r["simple"].as_array().unwrap().len() == 1),
        "{checks:?}"
    );
    env.tilefs_ok(&["fsck", "--store", store.to_str().unwrap()]);
    // skopeo's sigstore signature: accepted with its public key, refused
    // with another.
    let sig_other_key = env.policy("sig-other-key.json", &sigstore_signed(&other_pub, ""));
    if skopeo_sigstore {
        env.pull(&env.area.path("sigstore"), &sig_ref, &sig_ok, &flags).unwrap();
        let e = env
            .pull(&env.area.path("sigstore2"), &sig_ref, &sig_other_key, &flags)
            .unwrap_err();
        assert!(e.contains("sigstoreSigned: no signature is acceptable"), "{e}");
        assert!(tagged(&env.area.path("sigstore2")).is_empty());
    }

    // Refused, naming the image, the scope and why; nothing tagged.
    let fresh = env.area.path("refused");
    let cases: Vec<(&str, &Path, &str)> = vec![
        (&gpg_ref, &gpg_other, "does not list"),
        (&gpg_ref, &gpg_identity, "claims the identity"),
        (&plain_ref, &gpg_ok, "no signature"),
        (&gpg_ref, &sig_ok, "no signature"),
        (&plain_ref, &sig_other, "no signature"),
        (&gpg_ref, &reject, "rejects every image"),
    ];
    for (r, policy, why) in &cases {
        let e = env.pull(&fresh, r, policy, &flags).unwrap_err();
        assert!(e.contains(why), "{r} under {}: {e}", policy.display());
        assert!(e.contains(&r.replace("docker://", "")), "{e}");
        assert!(e.contains("scope") || e.contains("default"), "{e}");
        assert!(tagged(&fresh).is_empty(), "{e}");
    }
    let e = env.pull(&fresh, &gpg_ref, &reject, &flags).unwrap_err();
    assert!(e.contains(&format!("scope \"{addr}/signed\"")), "{e}");

    // A signature for another image (moved to this one's place), and a
    // corrupt one, are refused.
    let other_ref = format!("docker://{addr}/signed/gpg:v2");
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            "--sign-by",
            &fpr,
            &format!("oci:{}:b", env.area.path("layout2").display()),
            &other_ref,
        ],
    );
    let d1 = manifest_digest(&env, &gpg_ref);
    let d2 = manifest_digest(&env, &other_ref);
    let sig1 = lookaside_dir(&env, "signed/gpg", &d1).join("signature-1");
    let sig2 = lookaside_dir(&env, "signed/gpg", &d2).join("signature-1");
    let good = fs::read(&sig1).unwrap();
    fs::copy(&sig2, &sig1).unwrap();
    let e = env.pull(&fresh, &gpg_ref, &gpg_ok, &flags).unwrap_err();
    assert!(e.contains("signs another image"), "{e}");
    let mut bad = good.clone();
    let n = bad.len();
    bad[n / 2] ^= 0x40;
    fs::write(&sig1, &bad).unwrap();
    let e = env.pull(&fresh, &gpg_ref, &gpg_ok, &flags).unwrap_err();
    assert!(e.contains("signedBy"), "{e}");
    fs::write(&sig1, &good).unwrap();
    assert!(tagged(&fresh).is_empty());

    // The same image under a mirror's name, signed under the vendor's:
    // remapIdentity accepts it, matchRepoDigestOrExact does not.
    let mirrored = format!("docker://{addr}/mirrored/gpg:v1");
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
            &gpg_ref,
            &mirrored,
        ],
    );
    let sigdir = lookaside_dir(&env, "mirrored/gpg", &d1);
    fs::create_dir_all(&sigdir).unwrap();
    fs::copy(&sig1, sigdir.join("signature-1")).unwrap();
    env.pull(&fresh, &mirrored, &gpg_remap, &flags).unwrap();
    let e = env.pull(&env.area.path("x"), &mirrored, &gpg_ok, &flags).unwrap_err();
    assert!(e.contains("claims the identity"), "{e}");

    // By digest, matchRepoDigestOrExact takes a signature of a tag of the
    // same repository.
    let by_digest = format!("docker://{addr}/signed/gpg@{d1}");
    env.pull(&env.area.path("d"), &by_digest, &gpg_ok, &flags).unwrap();

    // An OCI layout has no signatures: signedBy refuses it, its scope
    // accepts it.
    let e = env.pull(&fresh, &src, &gpg_ok, &[]).unwrap_err();
    assert!(e.contains("global default") && e.contains("reject"), "{e}");
    let local = env.policy(
        "local.json",
        &format!(
            r#"{{"default":[{{"type":"reject"}}],"transports":{{"oci":{{"{}":[{{"type":"insecureAcceptAnything"}}]}}}}}}"#,
            layout.display()
        ),
    );
    env.pull(&fresh, &src, &local, &[]).unwrap();

    // No policy file at all: refused, as podman refuses.
    let out = env.tilefs(&[
        "pull",
        "-q",
        "--store",
        fresh.to_str().unwrap(),
        "--signature-policy",
        "/nonexistent/policy.json",
        &src,
    ]);
    assert!(!out.status.success());
}

#[test]
fn images_tilefs_signs_are_accepted_by_skopeo_and_by_tilefs() {
    let env = Env::new();
    let registry = Registry::start(&env.area);
    let addr = registry.addr.clone();
    env.registries_d(&[&addr]);
    let (fpr, key) = env.gpg_key("builder");
    let (_, other_key) = env.gpg_key("stranger");
    let (sig_priv, sig_pub) = env.sigstore_key("signer");
    let src = env.area.dir("src");
    for i in 0..20 {
        fs::write(src.join(format!("f{i}")), format!("file {i} ").repeat(200 * (i + 1))).unwrap();
    }
    let store = env.area.path("store");
    env.tilefs_ok(&[
        "build",
        "-q",
        "--store",
        store.to_str().unwrap(),
        "--tag",
        "app",
        src.to_str().unwrap(),
    ]);
    let remote = format!("docker://{addr}/team/app:v1");
    let pw = env.area.path("passphrase");
    let out = env.tilefs_ok(&[
        "push",
        "-q",
        "--store",
        store.to_str().unwrap(),
        "--tls-verify=false",
        "--registries.d",
        env.regd.to_str().unwrap(),
        "--registries-conf",
        env.conf.to_str().unwrap(),
        "--sign-by",
        &fpr,
        "--sign-by-sigstore-private-key",
        sig_priv.to_str().unwrap(),
        "--sign-passphrase-file",
        pw.to_str().unwrap(),
        "app",
        &remote,
    ]);
    let digest = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(digest, manifest_digest(&env, &remote));

    // skopeo accepts the artifact under policies that require either
    // signature, and refuses it under one that requires another key.
    let gpg_ok = env.policy("gpg.json", &signed_by(&key, ""));
    let sig_ok = env.policy("sig.json", &sigstore_signed(&sig_pub, ""));
    let gpg_other = env.policy("gpg-other.json", &signed_by(&other_key, ""));
    for (i, p) in [&gpg_ok, &sig_ok].iter().enumerate() {
        let dest = env.area.path(&format!("copy{i}"));
        let out = env.skopeo(
            Some(p),
            &[
                "copy",
                "-q",
                "--src-tls-verify=false",
                &remote,
                &format!("dir:{}", dest.display()),
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && err.contains("sigstore disabled") {
            // Debian's skopeo 1.9.3 is built without sigstore.
            eprintln!(
                "this skopeo cannot check sigstore signatures ({}); openssl checks them below",
                err.trim()
            );
            continue;
        }
        assert!(out.status.success(), "skopeo under {}: {err}", p.display());
    }
    // The sigstore attachment, checked without tilefs: its payload claims
    // this manifest and identity, and openssl verifies its signature with
    // the public key.
    let tag = format!("sha256-{}.sig", digest.trim_start_matches("sha256:"));
    let att: serde_json::Value = serde_json::from_slice(
        &env.skopeo_ok(
            None,
            &[
                "inspect",
                "--tls-verify=false",
                "--raw",
                &format!("docker://{addr}/team/app:{tag}"),
            ],
        )
        .stdout,
    )
    .unwrap();
    let layer = &att["layers"][0];
    assert_eq!(layer["mediaType"], "application/vnd.dev.cosign.simplesigning.v1+json");
    let payload = fs::read(registry.blob_file(layer["digest"].as_str().unwrap())).unwrap();
    let claim: serde_json::Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(claim["critical"]["type"], "cosign container image signature");
    assert_eq!(claim["critical"]["image"]["docker-manifest-digest"], digest.as_str());
    assert_eq!(
        claim["critical"]["identity"]["docker-reference"],
        format!("{addr}/team/app:v1")
    );
    use base64::Engine;
    let der = base64::engine::general_purpose::STANDARD
        .decode(
            layer["annotations"]["dev.cosignproject.cosign/signature"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
    fs::write(env.area.path("payload"), &payload).unwrap();
    fs::write(env.area.path("payload.sig"), &der).unwrap();
    let out = Command::new("openssl")
        .args(["dgst", "-sha256", "-verify"])
        .arg(&sig_pub)
        .arg("-signature")
        .arg(env.area.path("payload.sig"))
        .arg(env.area.path("payload"))
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = env.skopeo(
        Some(&gpg_other),
        &[
            "copy",
            "-q",
            "--src-tls-verify=false",
            &remote,
            &format!("dir:{}", env.area.path("copy-x").display()),
        ],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("rejected"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // skopeo's own check of the simple signature.
    let manifest = env.area.path("manifest.json");
    fs::write(
        &manifest,
        env.skopeo_ok(None, &["inspect", "--tls-verify=false", "--raw", &remote])
            .stdout,
    )
    .unwrap();
    let sig = lookaside_dir(&env, "team/app", &digest).join("signature-1");
    env.skopeo_ok(
        None,
        &[
            "standalone-verify",
            manifest.to_str().unwrap(),
            &format!("{addr}/team/app:v1"),
            &fpr,
            sig.to_str().unwrap(),
        ],
    );

    // tilefs accepts its own signatures, fully and lazily.
    for (i, p) in [&gpg_ok, &sig_ok].iter().enumerate() {
        env.pull(
            &env.area.path(&format!("pulled{i}")),
            &remote,
            p,
            &["--tls-verify=false"],
        )
        .unwrap();
    }
    let lazy = env.area.path("lazy");
    let policy = env.policy("lazy.json", &fs::read_to_string(&sig_ok).unwrap());
    env.pull(&lazy, &remote, &policy, &["--tls-verify=false", "--lazy"])
        .unwrap();
    let e = env
        .pull(
            &env.area.path("lazy2"),
            &remote,
            &gpg_other,
            &["--tls-verify=false", "--lazy"],
        )
        .unwrap_err();
    assert!(e.contains("does not list"), "{e}");
    assert!(tagged(&env.area.path("lazy2")).is_empty());

    // A lazy mount's fetches check the policy again: accepted, the file
    // reads; once the policy refuses the image, the mount's reads fail.
    require(cannot_fuse());
    let tag = format!("{addr}_team_app:v1");
    for (round, expect_ok) in [(0, true), (1, false)] {
        if !expect_ok {
            fs::write(&policy, r#"{"default":[{"type":"reject"}]}"#).unwrap();
        }
        let mnt = env.area.dir(&format!("mnt{round}"));
        let log = env.area.path(&format!("fuse{round}.log"));
        let out = env.tilefs(&[
            "mount",
            "--fuse",
            "--store",
            lazy.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
            &tag,
            mnt.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // A file whose object no earlier read fetched.
        let file = if expect_ok { "f3" } else { "f15" };
        let read = fs::read(mnt.join(file));
        let _ = env.tilefs(&["umount", mnt.to_str().unwrap()]);
        if is_mounted(&mnt) {
            let _ = rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::DETACH);
        }
        if expect_ok {
            assert_eq!(read.unwrap(), fs::read(src.join("f3")).unwrap());
        } else {
            assert!(read.is_err(), "read through a mount the policy now refuses");
            let text = fs::read_to_string(&log).unwrap_or_default();
            assert!(text.contains("signature policy"), "{text}");
        }
    }
}

#[test]
fn registries_conf_routes_pulls() {
    let env = Env::new();
    let registry = Registry::start(&env.area);
    let addr = registry.addr.clone();
    let mirror_area = Area::new();
    let mirror = Registry::start(&mirror_area);
    env.registries_d(&[&addr]);
    let accept = env.policy("accept.json", accept_anything());
    let layout = env.area.dir("layout");
    oci_layout(&layout, "a", "the image");
    let layout2 = env.area.dir("layout2");
    oci_layout(&layout2, "b", "another image");
    let remote = format!("docker://{addr}/team/app:v1");
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            &format!("oci:{}:a", layout.display()),
            &remote,
        ],
    );
    let digest = manifest_digest(&env, &remote);
    let store = env.area.path("store");
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let write = |text: &str| fs::write(&env.conf, text).unwrap();

    // A registry marked insecure is reached without --tls-verify=false; the
    // command line still wins.
    write(&format!("[[registry]]\nlocation = \"{addr}\"\ninsecure = true\n"));
    let d = env.pull(&store, &remote, &accept, &[]).unwrap();
    assert!(env.pull(&store, &remote, &accept, &["--tls-verify=true"]).is_err());
    write("");
    assert!(env.pull(&store, &remote, &accept, &[]).is_err());

    // Mirrors in order, then the registry: one that is down is passed over.
    write(&format!(
        "[[registry]]\nlocation = \"{addr}\"\ninsecure = true\n[[registry.mirror]]\nlocation = \"{down}\"\ninsecure = true\n"
    ));
    assert_eq!(env.pull(&env.area.path("s1"), &remote, &accept, &[]).unwrap(), d);

    // A mirror that has the image serves it (the registry is not asked).
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
            &remote,
            &format!("docker://{}/team/app:v1", mirror.addr),
        ],
    );
    write(&format!(
        "[[registry]]\nlocation = \"{addr}\"\ninsecure = true\n[[registry.mirror]]\nlocation = \"{}\"\ninsecure = true\n",
        mirror.addr
    ));
    let before = registry.requests().len();
    assert_eq!(env.pull(&env.area.path("s2"), &remote, &accept, &[]).unwrap(), d);
    assert_eq!(
        registry.requests().len(),
        before,
        "the registry was asked though the mirror had the image"
    );

    // A mirror that serves another image under this digest is refused by
    // the digest.
    let other = format!("docker://{}/team/other:v1", mirror.addr);
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            &format!("oci:{}:b", layout2.display()),
            &other,
        ],
    );
    let other_manifest = env
        .skopeo_ok(None, &["inspect", "--tls-verify=false", "--raw", &other])
        .stdout;
    fs::write(mirror.blob_file(&digest), &other_manifest).unwrap();
    let by_digest = format!("docker://{addr}/team/app@{digest}");
    let e = env.pull(&env.area.path("s3"), &by_digest, &accept, &[]).unwrap_err();
    assert!(
        e.contains("does not match its digest") && e.contains(&mirror.addr),
        "{e}"
    );
    assert!(tagged(&env.area.path("s3")).is_empty());

    // A blocked registry is refused, naming the table.
    write(&format!(
        "[[registry]]\nprefix = \"{addr}/team\"\nlocation = \"{addr}/team\"\nblocked = true\n"
    ));
    let e = env
        .pull(&env.area.path("s4"), &remote, &accept, &["--tls-verify=false"])
        .unwrap_err();
    assert!(e.contains("blocked") && e.contains(&format!("{addr}/team")), "{e}");

    // Host names match tables without regard to case, as DNS names do (a
    // block is not passed by writing the host in capitals; skopeo 1.9
    // compares them as written).
    let port = addr.rsplit_once(':').unwrap().1;
    write(&format!(
        "[[registry]]\nlocation = \"localhost:{port}\"\ninsecure = true\n[[registry]]\nprefix = \"localhost:{port}/team/app\"\nlocation = \"localhost:{port}/team/app\"\nblocked = true\n"
    ));
    for shouting in [
        format!("LocalHost:{port}/team/app:v1"),
        format!("LOCALHOST:{port}/team/app@{digest}"),
    ] {
        let e = env
            .pull(&env.area.path("s4"), &format!("docker://{shouting}"), &accept, &[])
            .unwrap_err();
        assert!(e.contains("is blocked"), "{shouting}: {e}");
    }
    // ... and `insecure` applies to LOCALHOST as to localhost.
    let other = format!("docker://{addr}/team/other:v1");
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            &format!("oci:{}:b", layout2.display()),
            &other,
        ],
    );
    env.pull(
        &env.area.path("s4"),
        &format!("docker://LOCALHOST:{port}/team/other:v1"),
        &accept,
        &[],
    )
    .unwrap();

    // Short names: an alias; one search registry; several, which
    // enforcing refuses without a terminal and permissive tries in order.
    // Drop-ins in FILE.d/ apply over the file; the environment names the
    // file too.
    write(&format!(
        "unqualified-search-registries = [\"{down}\", \"{addr}\"]\nshort-name-mode = \"enforcing\"\n[[registry]]\nlocation = \"{addr}\"\ninsecure = true\n[[registry]]\nlocation = \"{down}\"\ninsecure = true\n"
    ));
    let e = env.pull(&env.area.path("s5"), "team/app:v1", &accept, &[]).unwrap_err();
    assert!(e.contains("ambiguous"), "{e}");
    let dropins = PathBuf::from(format!("{}.d", env.conf.display()));
    fs::create_dir_all(&dropins).unwrap();
    fs::write(
        dropins.join("50-alias.conf"),
        format!("[aliases]\n\"app\" = \"{addr}/team/app\"\n"),
    )
    .unwrap();
    assert_eq!(env.pull(&env.area.path("s6"), "app:v1", &accept, &[]).unwrap(), d);
    fs::write(dropins.join("60-mode.conf"), "short-name-mode = \"permissive\"\n").unwrap();
    assert_eq!(env.pull(&env.area.path("s7"), "team/app:v1", &accept, &[]).unwrap(), d);
    // Through $CONTAINERS_REGISTRIES_CONF instead of the flag.
    let out = env
        .cmd(&tilefs_bin())
        .env("CONTAINERS_REGISTRIES_CONF", &env.conf)
        .args([
            "pull",
            "-q",
            "--store",
            env.area.path("s8").to_str().unwrap(),
            "--signature-policy",
            accept.to_str().unwrap(),
            "app:v1",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Issue 43: host names have no case, so an image cannot pass its scope's
/// requirements by spelling its registry in capitals: a `reject` or a
/// `signedBy` scope of `localhost:PORT/team/app` holds for
/// `LOCALHOST:PORT/team/app`, a scope written `LocalHost:PORT/team` holds
/// for `localhost:PORT/team/app`, and a registries.d key written in
/// capitals says where the signatures of `localhost:PORT` are. (skopeo 1.9
/// compares them as written.)
#[test]
fn policy_scopes_hold_whatever_the_case_of_the_host() {
    let env = Env::new();
    let registry = Registry::start(&env.area);
    let port = registry.addr.rsplit_once(':').unwrap().1.to_string();
    let layout = env.area.dir("layout");
    oci_layout(&layout, "a", "the image");
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            &format!("oci:{}:a", layout.display()),
            &format!("docker://localhost:{port}/team/app:v1"),
        ],
    );
    fs::write(
        &env.conf,
        format!("[[registry]]\nlocation = \"localhost:{port}\"\ninsecure = true\n"),
    )
    .unwrap();
    let store = env.area.path("store");
    let scoped = |name: &str, scope: &str, requirement: &str| {
        env.policy(
            name,
            &format!(
                r#"{{"default":[{{"type":"insecureAcceptAnything"}}],"transports":{{"docker":{{"{scope}":[{requirement}]}}}}}}"#
            ),
        )
    };
    let reject = scoped(
        "reject.json",
        &format!("localhost:{port}/team/app"),
        r#"{"type":"reject"}"#,
    );
    for shouting in [
        format!("LOCALHOST:{port}/team/app:v1"),
        format!("LocalHost:{port}/team/app:v1"),
    ] {
        let e = env
            .pull(&store, &format!("docker://{shouting}"), &reject, &[])
            .unwrap_err();
        assert!(
            e.contains("refused by the signature policy")
                && e.contains(&format!("scope \"localhost:{port}/team/app\" of transport docker")),
            "{shouting}: {e}"
        );
    }
    let reject = scoped(
        "reject-team.json",
        &format!("LocalHost:{port}/team"),
        r#"{"type":"reject"}"#,
    );
    let e = env
        .pull(&store, &format!("docker://localhost:{port}/team/app:v1"), &reject, &[])
        .unwrap_err();
    assert!(e.contains(&format!("scope \"localhost:{port}/team\"")), "{e}");

    // signedBy: no signature where registries.d (its key in capitals) says
    // they are.
    let (_, key) = env.gpg_key("case");
    fs::write(
        env.regd.join("test.yaml"),
        format!(
            "docker:\n  LOCALHOST:{port}:\n    lookaside: file://{}\n",
            env.sigs.display()
        ),
    )
    .unwrap();
    let signed = scoped(
        "signed.json",
        &format!("localhost:{port}/team/app"),
        &format!(
            r#"{{"type":"signedBy","keyType":"GPGKeys","keyPath":"{}"}}"#,
            key.display()
        ),
    );
    let e = env
        .pull(&store, &format!("docker://LOCALHOST:{port}/team/app:v1"), &signed, &[])
        .unwrap_err();
    assert!(
        e.contains("signedBy: no signature") && e.contains(&env.sigs.display().to_string()),
        "{e}"
    );
    assert!(tagged(&store).is_empty());
    // The same image by its lower-case name passes a policy that has no
    // scope for it, and the capitals name the same image.
    let accept = env.policy("accept.json", accept_anything());
    let a = env
        .pull(&store, &format!("docker://localhost:{port}/team/app:v1"), &accept, &[])
        .unwrap();
    let b = env
        .pull(&store, &format!("docker://LOCALHOST:{port}/team/app:v1"), &accept, &[])
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn endless_signatures_are_refused_at_their_size_cap() {
    let env = Env::new();
    let registry = Registry::start(&env.area);
    let layout = env.area.dir("layout");
    oci_layout(&layout, "a", "the image");
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            &format!("oci:{}:a", layout.display()),
            &format!("docker://{}/team/app:v1", registry.addr),
        ],
    );
    // Signature attachments (`sha256-HEX.sig`) and lookaside signatures
    // that stream forever.
    let relay = Relay::answering(&registry.addr, |_, path| {
        match path.ends_with(".sig") || path.starts_with("/sigs/") {
            true => Answer::Endless("application/vnd.oci.image.manifest.v1+json"),
            false => Answer::Forward,
        }
    });
    fs::write(
        env.regd.join("test.yaml"),
        format!(
            "docker:\n  {0}:\n    lookaside: http://{0}/sigs\n    use-sigstore-attachments: true\n",
            relay.addr
        ),
    )
    .unwrap();
    let (_, sigstore_pub) = env.sigstore_key("cosign");
    let (_, gpg_pub) = env.gpg_key("signer");
    let remote = format!("docker://{}/team/app:v1", relay.addr);
    for (policy, what) in [
        (sigstore_signed(&sigstore_pub, ""), "signature attachments"),
        (signed_by(&gpg_pub, ""), "lookaside signature"),
    ] {
        let policy = env.policy("policy.json", &policy);
        let store = env.area.path("store");
        let mut cmd = env.cmd(&tilefs_bin());
        cmd.args(["pull", "-q", "--tls-verify=false", "--store"])
            .arg(&store)
            .arg("--signature-policy")
            .arg(&policy)
            .arg("--registries.d")
            .arg(&env.regd)
            .arg("--registries-conf")
            .arg(&env.conf)
            .arg(&remote);
        let w = oci::watch(cmd, None, std::time::Duration::from_secs(120));
        let err = stderr(&w.out);
        assert_eq!(w.out.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains("larger than 4 MiB (the limit)"), "{what}: {err}");
        assert!(w.peak_mib < 150, "{what}: {} MiB", w.peak_mib);
        assert!(w.took < std::time::Duration::from_secs(15), "{what}: {:?}", w.took);
        assert!(tagged(&store).is_empty());
    }
}

#[test]
fn a_lazy_pull_under_a_policy_that_wants_signatures_uses_only_a_signed_index() {
    let env = Env::new();
    let registry = Registry::start(&env.area);
    let addr = registry.addr.clone();
    env.registries_d(&[&addr]);
    let (fpr, key) = env.gpg_key("alice");
    let layout = env.area.dir("layout");
    oci_layout(&layout, "a", "an ordinary image");
    let remote = format!("docker://{addr}/signed/app:v1");
    let src = format!("oci:{}:a", layout.display());
    env.skopeo_ok(
        None,
        &[
            "copy",
            "-q",
            "--dest-tls-verify=false",
            "--sign-by",
            &fpr,
            &src,
            &remote,
        ],
    );
    let policy = env.policy("gpg.json", &signed_by(&key, ""));
    let (regd, conf, pol) = (
        env.regd.to_str().unwrap(),
        env.conf.to_str().unwrap(),
        policy.to_str().unwrap(),
    );
    let common = [
        "--json",
        "--tls-verify=false",
        "--registries.d",
        regd,
        "--registries-conf",
        conf,
        "--signature-policy",
        pol,
    ];
    let run = |args: &[&str]| {
        let out = env.tilefs_ok(&[args, &common[..], &[&remote]].concat());
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let store = |name: &str| env.area.path(name).to_str().unwrap().to_string();

    // An index nobody signed: the image (signed) is pulled whole, saying
    // the policy refused its index.
    let unsigned = run(&["index", "--store", &store("ix1")]);
    let report = run(&["pull", "--lazy", "--store", &store("store1")]);
    let why = report["lazy_fallback"].as_str().unwrap_or_default();
    let named = unsigned["manifest_digest"].as_str().unwrap();
    assert!(
        why.contains(named) && why.contains("refused by the signature policy") && why.contains("no signature"),
        "{report}"
    );
    assert_eq!(report["lazy_index"], serde_json::Value::Null, "{report}");
    assert_eq!(report["digest"], unsigned["digest"]);

    // The index signed with the key the policy names: used.
    let signed = run(&["index", "--store", &store("ix2"), "--sign-by", &fpr]);
    let report = run(&["pull", "--lazy", "--store", &store("store2")]);
    assert_eq!(report["lazy_index"], signed["manifest_digest"], "{report}");
    assert_eq!(report["lazy_fallback"], serde_json::Value::Null, "{report}");
    assert_eq!(report["digest"], signed["digest"]);
}
