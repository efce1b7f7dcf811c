//! `tilefs pull`: OCI layouts written here, archives and a real registry
//! (Debian's docker-registry on loopback) filled by skopeo, compared with
//! composefs-rs's digest and with `umoci unpack` of the same image.

mod common;

use common::oci::{watch, Watched};
use common::registry::{write_auth, Answer, Registry, Relay, TokenServer};
use common::*;
use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The image `compat_image` writes, as composefs-rs 0.9 identifies it:
/// `cfsctl init --algorithm fsverity-sha256-12 --insecure R`,
/// `cfsctl --repo R oci pull oci:DIR:compat x`, `cfsctl --repo R oci compute-id x`
/// (cfsctl built with `cargo build --release -p composefs-ctl` at v0.9.0).
const COMPOSEFS_RS_DIGEST: &str = "7690c9a2b84841ccc2874d95686f9cc12d60d8cd53790e9118b45b0e58022519";

// ---- writing OCI layouts -------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Comp {
    None,
    Gzip,
    Zstd,
}

/// One tar member.
#[derive(Clone)]
struct E {
    name: String,
    kind: tar::EntryType,
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
    data: Vec<u8>,
    link: Option<String>,
    dev: (u32, u32),
    pax: Vec<(String, Vec<u8>)>,
}

fn e(name: &str, kind: tar::EntryType) -> E {
    E {
        name: name.into(),
        kind,
        mode: if kind == tar::EntryType::Directory {
            0o755
        } else {
            0o644
        },
        uid: 0,
        gid: 0,
        mtime: 1_700_000_000,
        data: Vec::new(),
        link: None,
        dev: (0, 0),
        pax: Vec::new(),
    }
}
fn dir(name: &str) -> E {
    e(name, tar::EntryType::Directory)
}
fn file(name: &str, data: &[u8]) -> E {
    E {
        data: data.to_vec(),
        ..e(name, tar::EntryType::Regular)
    }
}
fn link(name: &str, kind: tar::EntryType, target: &str) -> E {
    E {
        link: Some(target.into()),
        ..e(name, kind)
    }
}

fn tar_of(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for x in entries {
        if !x.pax.is_empty() {
            b.append_pax_extensions(x.pax.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
                .unwrap();
        }
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(x.kind);
        h.set_mode(x.mode);
        h.set_uid(x.uid);
        h.set_gid(x.gid);
        h.set_mtime(x.mtime);
        h.set_size(x.data.len() as u64);
        if x.kind == tar::EntryType::Char || x.kind == tar::EntryType::Block {
            h.set_device_major(x.dev.0).unwrap();
            h.set_device_minor(x.dev.1).unwrap();
        }
        let hostile = x.name.starts_with('/') || x.name.split('/').any(|c| c == "..");
        match &x.link {
            Some(l) => b.append_link(&mut h, &x.name, l).unwrap(),
            // The tar writer refuses names that escape: write them raw.
            None if hostile => {
                h.as_old_mut().name[..x.name.len()].copy_from_slice(x.name.as_bytes());
                h.set_cksum();
                b.append(&h, x.data.as_slice()).unwrap();
            }
            None => b.append_data(&mut h, &x.name, x.data.as_slice()).unwrap(),
        }
    }
    b.into_inner().unwrap()
}

fn put_blob(layout: &Path, data: &[u8]) -> (String, usize) {
    let hex = sha256_hex(data);
    let dir = layout.join("blobs/sha256");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(&hex), data).unwrap();
    (format!("sha256:{hex}"), data.len())
}

fn compress(data: &[u8], c: Comp) -> (Vec<u8>, &'static str) {
    match c {
        Comp::None => (data.to_vec(), "application/vnd.oci.image.layer.v1.tar"),
        Comp::Gzip => {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
            enc.write_all(data).unwrap();
            (enc.finish().unwrap(), "application/vnd.oci.image.layer.v1.tar+gzip")
        }
        Comp::Zstd => (
            zstd::encode_all(data, 3).unwrap(),
            "application/vnd.oci.image.layer.v1.tar+zstd",
        ),
    }
}

/// Writes (or adds to) an OCI layout an image named `name` whose layers
/// are the given raw blobs (already compressed) and their diff ids.
fn write_image_blobs(layout: &Path, name: &str, layers: &[(Vec<u8>, &str, String)]) -> String {
    let descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|(blob, mt, _)| {
            let (d, n) = put_blob(layout, blob);
            serde_json::json!({"mediaType": mt, "digest": d, "size": n})
        })
        .collect();
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.2.clone()).collect::<Vec<_>>()},
    });
    let (cd, cn) = put_blob(layout, config.to_string().as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
        "layers": descs,
    });
    let (md, mn) = put_blob(layout, manifest.to_string().as_bytes());
    let index_path = layout.join("index.json");
    let mut index: serde_json::Value = fs::read(&index_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| serde_json::json!({"schemaVersion": 2, "manifests": []}));
    index["manifests"].as_array_mut().unwrap().push(serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
        "annotations": {"org.opencontainers.image.ref.name": name},
    }));
    fs::write(&index_path, index.to_string()).unwrap();
    fs::write(layout.join("oci-layout"), r#"{"imageLayoutVersion": "1.0.0"}"#).unwrap();
    md
}

fn write_image(layout: &Path, name: &str, layers: &[(&[E], Comp)]) -> String {
    let blobs: Vec<(Vec<u8>, &str, String)> = layers
        .iter()
        .map(|(entries, c)| {
            let tar = tar_of(entries);
            let diff = format!("sha256:{}", sha256_hex(&tar));
            let (blob, mt) = compress(&tar, *c);
            (blob, mt, diff)
        })
        .collect();
    write_image_blobs(layout, name, &blobs)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Three layers (gzip, uncompressed, `last`) exercising every rule
/// composefs-rs and tilefs must agree on.
fn compat_layers(last: Comp) -> Vec<(Vec<E>, Comp)> {
    use tar::EntryType as T;
    let cap: Vec<u8> = vec![1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let l1 = vec![
        E {
            mode: 0o700,
            mtime: 5,
            ..dir("./")
        },
        E {
            mtime: 1_600_000_000,
            ..dir("usr")
        },
        dir("usr/bin"),
        E {
            mode: 0o4755,
            uid: 70000,
            gid: 70001,
            ..file("usr/bin/prog", &pattern(100_000, 1))
        },
        link("usr/bin/prog2", T::Link, "usr/bin/prog"),
        E {
            mode: 0o755,
            pax: vec![
                ("SCHILY.xattr.security.capability".into(), cap),
                ("SCHILY.xattr.user.foo".into(), b"bar".to_vec()),
            ],
            ..file("usr/bin/capped", &pattern(200, 2))
        },
        E {
            pax: vec![("uid".into(), b"3000000".to_vec())],
            ..file("usr/bin/bigid", &pattern(70, 3))
        },
        dir("usr/share"),
        file("usr/share/old", b"old"),
        file(&format!("usr/share/{}", "n".repeat(150)), b"long name"),
        E {
            pax: vec![("mtime".into(), b"1650000000.75".to_vec())],
            ..dir("etc")
        },
        file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n"),
        file("etc/x", b"file then dir"),
        link("lib", T::Symlink, "usr/lib"),
        link("longlink", T::Symlink, &format!("/{}", "t".repeat(200))),
        dir("dev"),
        E {
            mode: 0o666,
            dev: (1, 3),
            ..e("dev/null", T::Char)
        },
        E {
            mode: 0o660,
            dev: (8, 300),
            ..e("dev/sda", T::Block)
        },
        e("dev/fifo", T::Fifo),
        E { mtime: 1, ..dir("run") },
        file("run/lock", &pattern(170, 4)),
        file("empty", b""),
        file("sixtyfour", &[b'6'; 64]),
        file("sixtyfive", &[b'6'; 65]),
    ];
    let l2 = vec![
        file("etc/.wh.passwd", b""),
        file("usr/share/.wh..wh..opq", b""),
        file("usr/share/new", b"new"),
        E {
            mode: 0o750,
            uid: 5,
            ..dir("etc/x")
        },
        file("etc/x/inner", b"inner"),
    ];
    let l3 = vec![
        E {
            mtime: 1_700_000_001,
            ..file("etc/x", b"dir back to file")
        },
        link("usr/bin/prog3", T::Link, "usr/bin/prog"),
    ];
    vec![(l1, Comp::Gzip), (l2, Comp::None), (l3, last)]
}

fn write_compat(layout: &Path, name: &str, last: Comp) {
    let layers = compat_layers(last);
    let refs: Vec<(&[E], Comp)> = layers.iter().map(|(l, c)| (l.as_slice(), *c)).collect();
    write_image(layout, name, &refs);
}

fn pull(store: &Path, reference: &str, extra: &[&str]) -> String {
    let mut args = vec!["pull", "-q", "--store", store.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.push(reference);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|s| os(s)).collect();
    String::from_utf8(tilefs(&args).stdout).unwrap().trim().to_string()
}

fn fails(store: &Path, reference: &str, extra: &[&str]) -> String {
    let mut args = vec!["pull", "-q", "--store", store.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.push(reference);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|s| os(s)).collect();
    let out = tilefs_any(&args);
    assert_eq!(
        out.status.code(),
        Some(1),
        "pull {reference} should fail: {}",
        stderr(&out)
    );
    stderr(&out)
}

fn assert_fsck_clean(store: &Path) {
    if store.exists() {
        tilefs(&[os("fsck"), os("--store"), store.as_os_str()]);
    }
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn skopeo(args: &[&str]) {
    let out = Command::new("skopeo")
        .args(args)
        .output()
        .expect("skopeo (scripts/setup installs it)");
    assert!(out.status.success(), "skopeo {args:?}: {}", stderr(&out));
}

// ---- tests ---------------------------------------------------------------

#[test]
fn pull_gives_the_image_composefs_rs_gives() {
    let area = Area::new();
    let layout = area.path("layout");
    write_compat(&layout, "compat", Comp::Zstd);
    // To compute the expected digest with cfsctl: write the layout, stop.
    if let Some(keep) = std::env::var_os("TILEFS_WRITE_COMPAT_LAYOUT") {
        write_compat(Path::new(&keep), "compat", Comp::Zstd);
        return;
    }
    let store = area.path("store");
    let reference = format!("oci:{}:compat", layout.display());
    let digest = pull(&store, &reference, &[]);
    assert_eq!(
        digest, COMPOSEFS_RS_DIGEST,
        "not the image composefs-rs makes of this OCI image"
    );
    // The default tag: the layout's name and the image's.
    assert_eq!(tags_in(&store), ["layout:compat"]);
    // Again: same bytes, nothing new.
    let out = tilefs(&[
        os("pull"),
        os("--json"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os("again"),
        os(&reference),
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["digest"], COMPOSEFS_RS_DIGEST);
    assert_eq!(v["new_objects"], 0);
    assert_eq!(v["layers"], 3);
    // --all-xattrs keeps user.foo: another image.
    let all = pull(&store, &reference, &["--tag", "all", "--all-xattrs"]);
    assert_ne!(all, digest);
    assert_fsck_clean(&store);
}

#[test]
fn archives_and_a_registry_give_the_same_image() {
    if !have("skopeo") || !have("docker-registry") {
        panic!("skopeo and docker-registry are needed (scripts/setup installs them)");
    }
    let area = Area::new();
    let layout = area.path("layout");
    // Docker archives cannot carry zstd: all gzip here.
    write_compat(&layout, "gz", Comp::Gzip);
    let store = area.path("store");
    let want = pull(&store, &format!("oci:{}:gz", layout.display()), &[]);

    // Each into a store of its own: a store that has the image already
    // would not read the archive's layers at all.
    let oci_archive = area.path("img.tar");
    let docker_archive = area.path("docker.tar");
    for (i, (dest, source)) in [
        (
            format!("oci-archive:{}:gz", oci_archive.display()),
            format!("oci-archive:{}:gz", oci_archive.display()),
        ),
        (
            format!("docker-archive:{}:team/app:v1", docker_archive.display()),
            format!("docker-archive:{}", docker_archive.display()),
        ),
    ]
    .iter()
    .enumerate()
    {
        skopeo(&["copy", "-q", &format!("oci:{}:gz", layout.display()), dest]);
        let v = pull_json(&area.path(&format!("archive-store-{i}")), source, &[]);
        assert_eq!(v["digest"], want.as_str(), "{source}");
        assert!(v["blob_bytes"].as_u64().unwrap() > 0, "{source}: its layers were read");
    }
    // An image of a docker archive named as skopeo and docker write it:
    // short, or with its registry; normalized as containers/image does.
    for (i, name) in ["team/app:v1", "docker.io/team/app:v1"].iter().enumerate() {
        let source = format!("docker-archive:{}:{name}", docker_archive.display());
        let v = pull_json(&area.path(&format!("named-store-{i}")), &source, &[]);
        assert_eq!(v["digest"], want.as_str(), "{source}");
    }
    let err = fails(
        &area.path("named-store-x"),
        &format!("docker-archive:{}:team/app:v2", docker_archive.display()),
        &[],
    );
    assert!(err.contains("no image named \"team/app:v2\""), "{err}");

    let registry = Registry::start(&area);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    skopeo(&[
        "copy",
        "-q",
        "--dest-tls-verify=false",
        &format!("oci:{}:gz", layout.display()),
        &remote,
    ]);
    let fresh = area.path("fresh");
    assert_eq!(pull(&fresh, &remote, &["--tls-verify=false"]), want);
    let tags = tags_in(&fresh);
    assert_eq!(tags, [format!("{}_team_app:v1", registry.addr)]);
    // Every layer came over the wire once: at most the blobs' size.
    let blobs: u64 = fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let sent = registry.blob_bytes_sent();
    assert!(
        sent > 0 && sent <= blobs,
        "registry sent {sent} blob bytes; the layout holds {blobs}"
    );
    // By digest, too.
    let manifest = skopeo_inspect_digest(&remote);
    let by_digest = format!("docker://{}/team/app@{manifest}", registry.addr);
    assert_eq!(pull(&fresh, &by_digest, &["--tls-verify=false"]), want);
    // Plain HTTP needs --tls-verify=false, and says so.
    let err = fails(&area.path("s3"), &remote, &[]);
    assert!(err.contains("--tls-verify=false"), "{err}");
    // An unknown image.
    let err = fails(
        &area.path("s3"),
        &format!("docker://{}/team/nope:v1", registry.addr),
        &["--tls-verify=false"],
    );
    assert!(err.contains(&registry.addr) && err.contains("team/nope"), "{err}");
    assert!(err.contains("no repository team/nope"), "{err}");
    // A tag that is not there: said as such, with the tags there are.
    let err = fails(
        &area.path("s3"),
        &format!("docker://{}/team/app:v2", registry.addr),
        &["--tls-verify=false"],
    );
    assert!(
        err.contains(&format!(
            "registry {}: no tag \"v2\" in repository team/app (its tags: v1)",
            registry.addr
        )),
        "{err}"
    );
    assert!(!err.contains("OCI API error"), "{err}");
    // Names are lower case; a registry reference written without
    // docker:// where it cannot be a name.
    for bad in [
        format!("docker://{}/Team/app:v1", registry.addr),
        format!("{}/Team/app:v1", registry.addr),
        "Team/app:v1".to_string(),
    ] {
        let err = fails(&area.path("s3"), &bad, &["--tls-verify=false"]);
        assert!(err.contains("repository names are lower case"), "{bad}: {err}");
        assert!(err.contains("team/app:v1"), "{bad}: {err}");
    }
    assert!(!area.path("s3").exists(), "a failed pull left the store it created");
    assert!(!area.path("s3").exists(), "a failed pull left the store it created");
    // Its own pull tags are gc roots: gc keeps everything.
    tilefs(&[os("gc"), os("--store"), fresh.as_os_str()]);
    assert_fsck_clean(&fresh);
}

fn skopeo_inspect_digest(remote: &str) -> String {
    let out = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false", "--format", "{{.Digest}}", remote])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn a_registry_that_lies_or_stalls_fails_the_pull_cleanly() {
    let area = Area::new();
    let layout = area.path("layout");
    write_compat(&layout, "gz", Comp::Gzip);
    let registry = Registry::start(&area);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    skopeo(&[
        "copy",
        "-q",
        "--dest-tls-verify=false",
        &format!("oci:{}:gz", layout.display()),
        &remote,
    ]);
    // Change a layer's bytes where the registry keeps them (same size).
    let digest = registry.tamper_largest_blob();
    let store = area.path("store");
    let err = fails(&store, &remote, &["--tls-verify=false"]);
    assert!(err.contains(&digest), "the error names the blob: {err}");
    assert!(err.contains("does not match its digest"), "{err}");
    assert!(tags_in(&store).is_empty());
    assert_fsck_clean(&store);

    // A server that accepts and never answers: the timeout ends the pull.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    // --timeout is the time the user waits (loosely: well under twice).
    let t = Instant::now();
    let err = fails(
        &store,
        &format!("docker://{addr}/x/y:z"),
        &["--tls-verify=false", "--timeout", "3"],
    );
    assert!(t.elapsed() < Duration::from_secs(6), "took {:?}", t.elapsed());
    assert!(err.contains(&addr.to_string()), "{err}");
    assert!(err.contains("no answer within 3 s"), "{err}");
    // On a terminal (script(1) gives it one), the progress display says
    // what it is doing, and that it is waiting for the server.
    let cmd = format!(
        "{} pull --store {} --tls-verify=false --timeout 3 docker://{addr}/x/y:z",
        tilefs_bin().display(),
        store.display()
    );
    let out = on_terminal(&cmd);
    assert_eq!(out.status.code(), Some(1));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains(&format!("fetching the manifest of docker://{addr}/x/y:z")),
        "{shown}"
    );
    assert!(shown.contains("(waiting for the server, 2 s)"), "{shown}");
    assert!(shown.contains("no answer within 3 s"), "{shown}");
    drop(silent);
}

#[test]
fn bad_layers_are_refused_with_their_reason() {
    use tar::EntryType as T;
    let area = Area::new();
    let layout = area.path("layout");
    let base = vec![
        dir("usr"),
        file("usr/f", &pattern(5000, 9)),
        link("usr/sl", T::Symlink, "/etc"),
    ];
    let cases: Vec<(&str, Vec<E>, &str)> = vec![
        ("dotdot", vec![file("usr/../../etc/passwd", b"x")], "escapes the root"),
        ("absolute", vec![file("/etc/passwd", b"x")], "absolute"),
        ("symlinked-parent", vec![file("usr/sl/passwd", b"x")], "symlink"),
        ("absent-whiteout", vec![file("usr/.wh.nothing", b"")], "absent"),
        (
            "missing-link",
            vec![link("usr/h", T::Link, "usr/none")],
            "missing target",
        ),
    ];
    for (name, entries, _) in &cases {
        write_image(&layout, name, &[(&base, Comp::Gzip), (entries, Comp::Gzip)]);
    }
    write_image(&layout, "good", &[(&base, Comp::Gzip)]);
    let store = area.path("store");
    pull(
        &store,
        &format!("oci:{}:good", layout.display()),
        &["--tag", "unrelated"],
    );
    for (name, _, why) in &cases {
        let err = fails(&store, &format!("oci:{}:{name}", layout.display()), &[]);
        assert!(err.contains(why), "{name}: {err}");
        assert!(
            err.contains("layer sha256:"),
            "{name}: the error names the layer: {err}"
        );
    }
    assert_eq!(tags_in(&store), ["unrelated"]);
    assert_fsck_clean(&store);
}

#[test]
fn corrupt_blobs_and_manifests_are_refused() {
    let area = Area::new();
    let store = area.path("store");
    let layer = tar_of(&[dir("usr"), file("usr/big", &pattern(300_000, 7))]);
    let diff = format!("sha256:{}", sha256_hex(&layer));
    let (gz, gz_mt) = compress(&layer, Comp::Gzip);
    let (zs, zs_mt) = compress(&layer, Comp::Zstd);
    let make = |name: &str, blob: Vec<u8>, mt: &str| {
        let layout = area.path(name);
        write_image_blobs(&layout, "t", &[(blob, mt, diff.clone())]);
        format!("oci:{}:t", layout.display())
    };
    // Truncated streams (their digests match: the layout says what they are).
    let err = fails(&store, &make("trunc-gz", gz[..gz.len() / 2].to_vec(), gz_mt), &[]);
    assert!(err.contains("gzip") || err.contains("end"), "{err}");
    let err = fails(&store, &make("trunc-zstd", zs[..zs.len() / 2].to_vec(), zs_mt), &[]);
    assert!(err.contains("layer sha256:"), "{err}");
    let mut bad = gz.clone();
    let n = bad.len();
    bad[n / 2] ^= 0x55;
    bad[n / 2 + 1] ^= 0x55;
    let err = fails(&store, &make("corrupt-gz", bad, gz_mt), &[]);
    assert!(err.contains("layer sha256:"), "{err}");
    // A blob whose bytes are not its digest's.
    let ok = make("swapped", gz.clone(), gz_mt);
    let layout = area.path("swapped");
    let (d, _) = put_blob(&area.path("elsewhere"), &gz);
    let path = layout.join("blobs/sha256").join(d.trim_start_matches("sha256:"));
    let mut b = fs::read(&path).unwrap();
    b[100] ^= 1;
    fs::write(&path, b).unwrap();
    let err = fails(&store, &ok, &[]);
    assert!(err.contains(&d) && err.contains("does not match its digest"), "{err}");
    // A manifest that is not one.
    let layout = area.path("notjson");
    let (md, mn) = put_blob(&layout, b"this is not json");
    fs::write(
        layout.join("index.json"),
        serde_json::json!({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn}]}).to_string(),
    )
    .unwrap();
    let err = fails(&store, &format!("oci:{}", layout.display()), &[]);
    assert!(err.contains("not a manifest"), "{err}");
    // A layout without the name asked for lists what it has.
    let err = fails(&store, &format!("oci:{}:nope", area.path("swapped").display()), &[]);
    assert!(err.contains("no image named \"nope\"") && err.contains('t'), "{err}");
    assert!(tags_in(&store).is_empty());
    assert_fsck_clean(&store);
}

#[test]
fn pull_equals_umoci_unpack() {
    if !is_root() || !have("umoci") || !have("tar") {
        panic!("run as root with umoci and GNU tar (scripts/setup installs them)");
    }
    require(cannot_mount("erofs"));
    let area = Area::new();
    let layout = area.path("layout");
    // umoci reads no zstd.
    let mut layers = compat_layers(Comp::Gzip);
    // What composefs-rs refuses but runtimes accept: parents no entry lists.
    layers[1].0.push(file("opt/a/b/implied", b"implied parents"));
    // A sparse file, as GNU tar writes it in PAX format (umoci reads no
    // old GNU sparse headers; those are checked below).
    let (src, sparse) = sparse_tar(&area, "posix");
    let mut blobs: Vec<(Vec<u8>, &str, String)> = layers
        .iter()
        .map(|(l, c)| {
            let t = tar_of(l);
            let diff = format!("sha256:{}", sha256_hex(&t));
            let (b, mt) = compress(&t, *c);
            (b, mt, diff)
        })
        .collect();
    let diff = format!("sha256:{}", sha256_hex(&sparse));
    let (b, mt) = compress(&sparse, Comp::Gzip);
    blobs.push((b, mt, diff));
    write_image_blobs(&layout, "sem", &blobs);

    let bundle = area.path("bundle");
    let out = Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:sem", layout.display()))
        .arg(&bundle)
        .output()
        .unwrap();
    assert!(out.status.success(), "umoci unpack: {}", stderr(&out));
    let store = area.path("store");
    pull(&store, &format!("oci:{}:sem", layout.display()), &["--tag", "sem"]);
    let mnt = area.dir("mnt");
    tilefs(&[
        os("mount"),
        os("--store"),
        store.as_os_str(),
        os("sem"),
        mnt.as_os_str(),
    ]);
    let _guard = Mounted(mnt.clone());
    let want = scan(&bundle.join("rootfs"));
    let got = scan(&mnt);
    let mut compared = 0;
    for (path, w) in &want {
        // composefs-rs's rules: the root takes /usr's metadata, /run is
        // emptied, only security.capability is kept.
        if path.is_empty() || path.starts_with(b"run/") {
            continue;
        }
        let g = got
            .get(path)
            .unwrap_or_else(|| panic!("{} missing from the pull", String::from_utf8_lossy(path)));
        let p = String::from_utf8_lossy(path);
        // A symlink unpacked on disk is always 0777; the image keeps the
        // tar header's bits, as composefs-rs does.
        let mode = |s: &Seen| if s.link.is_some() { s.mode & S_IFMT } else { s.mode };
        assert_eq!(
            (mode(g), g.uid, g.gid, g.rdev, &g.link),
            (mode(w), w.uid, w.gid, w.rdev, &w.link),
            "{p}"
        );
        assert_eq!((g.size, g.nlink), (w.size, w.nlink), "{p}");
        // umoci keeps the sub-second part too; the parents no entry lists
        // it makes at the time of unpacking, tilefs at time zero (an image
        // is reproducible).
        // /run takes /usr's mtime (composefs-rs's rule).
        if (!path.starts_with(b"opt") || path.ends_with(b"implied")) && path != b"run" {
            assert_eq!(g.mtime, w.mtime, "{p}");
        }
        let cap = |s: &Seen| s.xattrs.get(std::ffi::OsStr::new("security.capability")).cloned();
        assert_eq!(cap(g), cap(w), "{p}");
        if w.mode & S_IFMT == S_IFREG {
            same_contents(&bundle.join("rootfs").join(&*p), &mnt.join(&*p)).unwrap();
        }
        compared += 1;
    }
    let extra: Vec<_> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(extra.is_empty(), "only in the pull: {extra:?}");
    assert!(compared > 25, "compared {compared}");
    // Hardlinks share one inode.
    let ino = |p: &str| fs::symlink_metadata(mnt.join(p)).unwrap().ino();
    assert_eq!(ino("usr/bin/prog"), ino("usr/bin/prog3"));
    assert_eq!(fs::metadata(mnt.join("usr/bin/prog2")).unwrap().nlink(), 3);
    let root = fs::metadata(&mnt).unwrap();
    let usr = fs::metadata(mnt.join("usr")).unwrap();
    assert_eq!((root.mode(), root.mtime()), (usr.mode(), usr.mtime()));
    assert_eq!(fs::read_dir(mnt.join("run")).unwrap().count(), 0);
    same_contents(&src.join("sparse"), &mnt.join("sparse")).unwrap();
    tilefs(&[os("umount"), mnt.as_os_str()]);

    // Old GNU sparse headers (GNU tar's default format).
    let (src, gnu) = sparse_tar(&area, "gnu");
    let diff = format!("sha256:{}", sha256_hex(&gnu));
    let (b, mt) = compress(&gnu, Comp::Zstd);
    write_image_blobs(&layout, "gnu-sparse", &[(b, mt, diff)]);
    pull(
        &store,
        &format!("oci:{}:gnu-sparse", layout.display()),
        &["--tag", "gnu"],
    );
    tilefs(&[
        os("mount"),
        os("--store"),
        store.as_os_str(),
        os("gnu"),
        mnt.as_os_str(),
    ]);
    same_contents(&src.join("sparse"), &mnt.join("sparse")).unwrap();
    tilefs(&[os("umount"), mnt.as_os_str()]);
    drop(_guard);
}

/// A 64 MiB file holding two short runs of data, tarred by GNU tar with
/// `--sparse` in `format`; the source directory and the tar.
fn sparse_tar(area: &Area, format: &str) -> (PathBuf, Vec<u8>) {
    use std::os::unix::fs::FileExt;
    let src = area.dir(&format!("sparse-{format}"));
    let f = fs::File::create(src.join("sparse")).unwrap();
    f.set_len(64 << 20).unwrap();
    f.write_at(b"in the middle", 32 << 20).unwrap();
    f.write_at(b"at the end", (64 << 20) - 10).unwrap();
    drop(f);
    let out = area.path(&format!("sparse-{format}.tar"));
    let st = Command::new("tar")
        .args([
            "--sparse",
            &format!("--format={format}"),
            "--owner=0",
            "--group=0",
            "--mtime=@1700000000",
            "-C",
        ])
        .arg(&src)
        .arg("-cf")
        .arg(&out)
        .arg("sparse")
        .status()
        .unwrap();
    assert!(st.success());
    let tar = fs::read(&out).unwrap();
    assert!(tar.len() < 1 << 20, "GNU tar wrote the file whole");
    (src, tar)
}

fn pull_json(store: &Path, reference: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["pull", "--json", "--store", store.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.push(reference);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|s| os(s)).collect();
    serde_json::from_slice(&tilefs(&args).stdout).unwrap()
}

#[test]
fn pulls_again_read_only_what_is_new_and_repair_what_is_missing() {
    let area = Area::new();
    let layout = area.path("layout");
    let layers = compat_layers(Comp::Gzip);
    let refs: Vec<(&[E], Comp)> = layers.iter().map(|(l, c)| (l.as_slice(), *c)).collect();
    write_image(&layout, "a", &refs);
    // B shares A's first two layers and has a new third one.
    let third = vec![dir("srv"), file("srv/data", &pattern(50_000, 11))];
    write_image(&layout, "b", &[refs[0], refs[1], (&third, Comp::Gzip)]);
    let store = area.path("store");
    let a = format!("oci:{}:a", layout.display());
    let b = format!("oci:{}:b", layout.display());
    let first = pull_json(&store, &a, &[]);
    assert!(first["blob_bytes"].as_u64().unwrap() > 0);
    // The same image again: no layer is read.
    let again = pull_json(&store, &a, &["--tag", "again"]);
    assert_eq!(
        (&again["digest"], &again["blob_bytes"]),
        (&first["digest"], &serde_json::json!(0))
    );
    // B: only its own layer is read.
    let bj = pull_json(&store, &b, &[]);
    let third_blob = compress(&tar_of(&third), Comp::Gzip).0.len() as u64;
    assert_eq!(bj["blob_bytes"].as_u64().unwrap(), third_blob, "{bj}");
    // An object removed behind tilefs's back: pulling again restores it.
    let out = tilefs(&[os("objects"), os("--store"), store.as_os_str(), os("layout:a")]);
    let objects = String::from_utf8(out.stdout).unwrap();
    let victim = objects.lines().next().unwrap().to_string();
    fs::remove_file(store.join(&victim)).unwrap();
    let err = tilefs_any(&[os("fsck"), os("--store"), store.as_os_str()]);
    assert_eq!(err.status.code(), Some(1), "fsck sees the missing object");
    let repaired = pull_json(&store, &a, &[]);
    assert_eq!(repaired["digest"], first["digest"]);
    assert!(repaired["blob_bytes"].as_u64().unwrap() > 0, "a layer was read again");
    assert!(store.join(&victim).is_file(), "{victim} restored");
    assert_fsck_clean(&store);
    // gc keeps what the tags use and the records of what it removed do
    // not mislead a later pull.
    tilefs(&[os("untag"), os("--store"), store.as_os_str(), os("layout:b")]);
    tilefs(&[os("gc"), os("--store"), store.as_os_str()]);
    let bj2 = pull_json(&store, &b, &[]);
    assert_eq!(bj2["digest"], bj["digest"]);
    assert_fsck_clean(&store);
    // Records that are FIFOs (planted in an untrusted store) are not read:
    // the pull neither hangs nor fails, it reads the layers again.
    for e in fs::read_dir(store.join(".layers")).unwrap() {
        let p = e.unwrap().path();
        fs::remove_file(&p).unwrap();
        assert!(Command::new("mkfifo").arg(&p).status().unwrap().success());
    }
    let mut child = Command::new(tilefs_bin())
        .args(["pull", "-q", "--store"])
        .arg(&store)
        .arg(&b)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pull hung on a FIFO in the store's records");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        bj["digest"].as_str().unwrap()
    );
}

/// Copies the layout's `gz` image to `private/app:v1` of `registry` as
/// alice; returns its reference and what a pull of the layout prints.
fn copy_to_private(area: &Area, layout: &Path, registry: &Registry) -> (String, String) {
    let remote = format!("docker://{}/private/app:v1", registry.addr);
    skopeo(&[
        "copy",
        "-q",
        "--dest-tls-verify=false",
        "--dest-creds",
        "alice:s3cret",
        &format!("oci:{}:gz", layout.display()),
        &remote,
    ]);
    (
        remote,
        pull(&area.path("ref"), &format!("oci:{}:gz", layout.display()), &[]),
    )
}

#[test]
fn registry_credentials_come_from_the_auth_files() {
    let area = Area::new();
    let layout = area.path("layout");
    write_compat(&layout, "gz", Comp::Gzip);
    let registry = Registry::start_with_password(&area, "alice", "s3cret", &area.path("auth-alice-s3cret.json"));
    let (remote, want) = copy_to_private(&area, &layout, &registry);
    let store = area.path("store");
    let auth_file = |user_pass: &str| {
        let p = area.path(&format!("auth-{}.json", user_pass.replace(':', "-")));
        write_auth(&p, &[&registry.addr], user_pass);
        p
    };
    let run = |file: Option<&Path>| {
        let mut c = Command::new(tilefs_bin());
        c.args(["pull", "-q", "--tls-verify=false", "--store"])
            .arg(&store)
            .arg(&remote);
        // Only the file given: not this machine's own credentials.
        c.env("HOME", area.path("home")).env_remove("XDG_RUNTIME_DIR");
        match file {
            Some(f) => c.env("REGISTRY_AUTH_FILE", f),
            None => c.env_remove("REGISTRY_AUTH_FILE"),
        };
        c.output().unwrap()
    };
    let anonymous = run(None);
    assert_eq!(anonymous.status.code(), Some(1));
    assert!(
        stderr(&anonymous).contains("no credentials for"),
        "{}",
        stderr(&anonymous)
    );
    let wrong = auth_file("alice:wrong");
    let refused = run(Some(&wrong));
    assert_eq!(refused.status.code(), Some(1));
    assert!(stderr(&refused).contains("were refused"), "{}", stderr(&refused));
    let right = auth_file("alice:s3cret");
    let ok = run(Some(&right));
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), want);
    assert_fsck_clean(&store);
}

/// An auth.json entry with an `identitytoken` (an OAuth2 refresh token,
/// as `docker login` keeps for registries that hand one out) is exchanged
/// at the registry's token server by the refresh-token grant, a POST, for
/// the pull's and the push's scopes; a token the server refuses fails
/// saying so and naming the file. Against docker-registry with token
/// authentication and a token server of the test's.
#[test]
fn an_identity_token_is_exchanged_at_the_token_server() {
    require(missing_program("openssl", "openssl"));
    let area = Area::new();
    let layout = area.path("layout");
    write_compat(&layout, "gz", Comp::Gzip);
    let tokens = TokenServer::start(&area, "alice", "s3cret", "refresh-of-alice");
    let registry = Registry::start_with(&area, &tokens.auth());
    let (remote, want) = copy_to_private(&area, &layout, &registry);
    let store = area.path("store");
    let auth_file = |token: &str| {
        let p = area.path(&format!("auth-{token}.json"));
        // `auth` holds docker's placeholder user, no password.
        let entry = serde_json::json!({"auth": "PHRva2VuPjo=", "identitytoken": token});
        fs::write(
            &p,
            serde_json::json!({"auths": {registry.addr.clone(): entry}}).to_string(),
        )
        .unwrap();
        p
    };
    let run = |file: &Path, args: &[&std::ffi::OsStr]| {
        let mut c = Command::new(tilefs_bin());
        c.args(args);
        c.env("HOME", area.path("home"))
            .env_remove("XDG_RUNTIME_DIR")
            .env("REGISTRY_AUTH_FILE", file);
        c.output().unwrap()
    };
    let pull_args = [
        os("pull"),
        os("-q"),
        os("--tls-verify=false"),
        os("--tag"),
        os("app"),
        os("--store"),
        store.as_os_str(),
        os(&remote),
    ];
    let wrong = auth_file("not-the-token");
    let refused = run(&wrong, &pull_args);
    assert_eq!(refused.status.code(), Some(1));
    let said = stderr(&refused);
    assert!(
        said.contains(&format!("the token server http://{}/token: HTTP 401", tokens.addr))
            && said.contains(&wrong.display().to_string()),
        "{said}"
    );
    let right = auth_file("refresh-of-alice");
    let ok = run(&right, &pull_args);
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), want);
    assert_fsck_clean(&store);
    // A push with it too (a token for pull and push).
    let copy = format!("docker://{}/private/copy:v1", registry.addr);
    let pushed = run(
        &right,
        &[
            os("push"),
            os("-q"),
            os("--tls-verify=false"),
            os("--store"),
            store.as_os_str(),
            os("app"),
            os(&copy),
        ],
    );
    assert!(pushed.status.success(), "{}", stderr(&pushed));
    let asked = tokens.asked.lock().unwrap().clone();
    let grant = |scope: &str| {
        asked.iter().any(|(method, p)| {
            let has = |k: &str, v: &str| p.iter().any(|(a, b)| a == k && b == v);
            method == "POST"
                && has("grant_type", "refresh_token")
                && has("refresh_token", "refresh-of-alice")
                && has("service", TokenServer::SERVICE)
                && has("scope", scope)
        })
    };
    assert!(
        grant("repository:private/app:pull") && grant("repository:private/copy:pull,push"),
        "{asked:?}"
    );
    let back = area.path("copy");
    let out = run(
        &right,
        &[
            os("pull"),
            os("-q"),
            os("--tls-verify=false"),
            os("--store"),
            back.as_os_str(),
            os(&copy),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want);
}

#[test]
fn a_user_without_privilege_pulls_the_same_image() {
    require(not_root("it makes the unprivileged user's area"));
    let area = Area::new();
    // The temporary directory is root's: the user works in one of its own.
    give_to_nobody(area.tmp.path());
    let layout = area.path("layout");
    write_compat(&layout, "compat", Comp::Zstd);
    Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(&layout)
        .status()
        .unwrap();
    let home = area.dir("home");
    give_to_nobody(&home);
    let mut cmd = Command::new(tilefs_bin());
    cmd.args(["pull", "-q"])
        .arg(format!("oci:{}:compat", layout.display()))
        .env("HOME", &home)
        .env("XDG_DATA_HOME", home.join("data"))
        .env_remove("TILEFS_STORE");
    let out = as_nobody(&mut cmd).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    // Owners (70000, 3000000), devices and setuid bits are kept in the
    // image, which needs no privilege: the digest is composefs-rs's.
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), COMPOSEFS_RS_DIGEST);
    let store = home.join("data/tilefs/store");
    assert_eq!(tags_in(&store), ["layout:compat"]);
    assert_eq!(fs::metadata(&store).unwrap().uid(), NOBODY);
}

// ---- names and lengths at their limits ------------------------------------

/// The deepest directory an image may hold (tilefs's image reader reads no
/// deeper: `tilefs_image::erofs::reader::MAX_DEPTH`).
const MAX_DEPTH: usize = 2048;

/// A name of `len` bytes that starts with `tag`.
fn long(tag: &str, len: usize) -> String {
    format!("{tag}{}", "x".repeat(len - tag.len()))
}

/// `x` with its name (and link target) in PAX records, the header holding
/// a short stand-in: tar carries long names this way or in GNU long-name
/// members (which the tar writer uses by itself), and layers use both.
fn pax_named(mut x: E) -> E {
    x.pax.push(("path".into(), std::mem::take(&mut x.name).into_bytes()));
    x.name = "stand-in".into();
    if let Some(l) = x.link.take() {
        x.pax.push(("linkpath".into(), l.into_bytes()));
        x.link = Some("stand-in".into());
    }
    x
}

/// `x` with these xattrs, in PAX records.
fn with_xattrs<K: AsRef<str>>(mut x: E, xattrs: &[(K, Vec<u8>)]) -> E {
    for (k, v) in xattrs {
        x.pax.push((format!("SCHILY.xattr.{}", k.as_ref()), v.clone()));
    }
    x
}

/// Directories `a`, `a/b`, ... down to `path`, each listed (composefs-rs
/// refuses parents no entry lists).
fn dirs_down_to(path: &str) -> Vec<E> {
    let parts: Vec<&str> = path.split('/').collect();
    (1..=parts.len()).map(|n| dir(&parts[..n].join("/"))).collect()
}

/// `n` nested one-byte directories: a path of 2n-1 bytes, past PATH_MAX
/// once n passes 2048.
fn nested(n: usize) -> String {
    vec!["n"; n].join("/")
}

/// 20 directories of 255-byte names: a path of 5119 bytes, past PATH_MAX.
fn deep_dir() -> String {
    (0..20)
        .map(|i| long(&format!("deep{i:02}-"), 255))
        .collect::<Vec<_>>()
        .join("/")
}

/// The layers of the image `limits`: names of 252 to 255 bytes whited out
/// by names of up to 259, an opaque directory and a whited-out directory
/// of 255-byte names, paths and a hardlink target past PATH_MAX, a 4095-byte
/// symlink target, the longest `security.capability` value EROFS holds,
/// and xattrs past the limits that the image drops (as composefs-rs
/// drops every xattr but `security.capability`).
fn limit_layers() -> Vec<(Vec<E>, Comp)> {
    use tar::EntryType as T;
    let deep = deep_dir();
    let mut l1 = vec![dir("usr"), dir("d")];
    for len in 252..=255 {
        l1.push(file(&format!("d/{}", long(&format!("w{len}-"), len)), b"whited out"));
    }
    l1.push(file(&format!("d/{}", long("kept-", 255)), b"kept"));
    let opaque = format!("d/{}", long("opaque-", 255));
    l1.extend([dir(&opaque), file(&format!("{opaque}/a"), b"a")]);
    let gone = format!("d/{}", long("gone-", 255));
    l1.extend([dir(&gone), file(&format!("{gone}/inner"), b"inner")]);
    l1.extend(dirs_down_to(&deep));
    l1.push(pax_named(file(&format!("{deep}/{}", long("file-", 255)), b"deep file")));
    l1.push(file(&format!("{deep}/{}", long("gone-", 255)), b"deep, whited out"));
    l1.push(pax_named(link(
        &format!("d/{}", long("link-", 255)),
        T::Link,
        &format!("{deep}/{}", long("file-", 255)),
    )));
    l1.push(link(
        &format!("{deep}/{}", long("link-", 255)),
        T::Link,
        &format!("d/{}", long("kept-", 255)),
    ));
    // A symlink target of PATH_MAX - 1 bytes, like a path: "/t/t/.../t".
    l1.push(link("s4095", T::Symlink, &"/t".repeat(2048)[..4095]));
    l1.push(pax_named(link("p4095", T::Symlink, &"p".repeat(4095))));
    l1.push(with_xattrs(
        file("cap", b"capable"),
        &[
            ("security.capability", vec![7; 65535]),
            (long("user.", 256).as_str(), b"name past XATTR_NAME_MAX".to_vec()),
            ("user.big", vec![1; 65536]),
        ],
    ));
    let mut l2 = Vec::new();
    for len in 252..=255 {
        let whiteout = file(&format!("d/.wh.{}", long(&format!("w{len}-"), len)), b"");
        // GNU long names for some, PAX records for others.
        l2.push(if len % 2 == 0 { whiteout } else { pax_named(whiteout) });
    }
    l2.push(file(&format!("{opaque}/.wh..wh..opq"), b""));
    l2.push(file(&format!("{opaque}/b"), b"b"));
    l2.push(file(&format!("d/.wh.{}", long("gone-", 255)), b""));
    l2.push(pax_named(file(&format!("{deep}/.wh.{}", long("gone-", 255)), b"")));
    vec![(l1, Comp::Gzip), (l2, Comp::Zstd)]
}

/// xattrs at their limits, kept with `--all-xattrs` (and by composefs-rs
/// with `--xattrs keep-user-xattrs`): the longest name, the longest value,
/// and a directory with three of those (near all an EROFS inode holds).
fn xattr_layer() -> Vec<E> {
    let values: Vec<(String, Vec<u8>)> = (b'a'..=b'c')
        .map(|c| (format!("user.{}", c as char), vec![c; 65535]))
        .collect();
    vec![
        dir("usr"),
        with_xattrs(
            file("x", b"x"),
            &[
                (long("user.", 255).as_str(), b"longest name".to_vec()),
                ("user.big", vec![b'v'; 65535]),
            ],
        ),
        with_xattrs(dir("big"), &values),
        file("big/f", b"f"),
    ]
}

/// The layer below each of [`past_limits`].
fn limits_base() -> Vec<E> {
    vec![dir("usr"), dir("d"), file("d/f", b"f")]
}

/// Layers past a limit, each over [`limits_base`]: the name of the
/// image, the layer, whether it needs `--all-xattrs` to be refused, and
/// what the error must say.
fn past_limits() -> Vec<(&'static str, Vec<E>, bool, &'static str)> {
    use tar::EntryType as T;
    vec![
        (
            "name256",
            vec![file(&format!("d/{}", long("n-", 256)), b"x")],
            false,
            "name 2 of its path is 256 bytes, longer than NAME_MAX (255)",
        ),
        (
            "dir256",
            vec![pax_named(file(&format!("{}/f", long("n-", 256)), b"x"))],
            false,
            "name 1 of its path is 256 bytes, longer than NAME_MAX (255)",
        ),
        (
            "whiteout256",
            vec![file(&format!("d/.wh.{}", long("n-", 256)), b"")],
            false,
            "name 2 of the path it removes is 256 bytes, longer than NAME_MAX (255)",
        ),
        (
            "opaque256",
            vec![pax_named(file(&format!("d/{}/.wh..wh..opq", long("n-", 256)), b""))],
            false,
            "name 2 of the directory it hides is 256 bytes, longer than NAME_MAX (255)",
        ),
        (
            "hardlink256",
            vec![link("d/h", T::Link, &format!("d/{}", long("n-", 256)))],
            false,
            "name 2 of its target is 256 bytes, longer than NAME_MAX (255)",
        ),
        (
            "symlink4096",
            vec![link("s", T::Symlink, &"/t".repeat(2048))],
            false,
            "symlink target is 4096 bytes, longer than 4095 (PATH_MAX",
        ),
        (
            "cap65536",
            vec![with_xattrs(file("c", b"c"), &[("security.capability", vec![7; 65536])])],
            false,
            "xattr value is 65536 bytes, longer than the 65535 an EROFS image holds",
        ),
        (
            "xname256",
            vec![with_xattrs(
                file("c", b"c"),
                &[(long("user.", 256).as_str(), b"v".to_vec())],
            )],
            true,
            "xattr name is 256 bytes, longer than 255 (XATTR_NAME_MAX)",
        ),
        (
            "xvalue65536",
            vec![with_xattrs(file("c", b"c"), &[("user.big", vec![1; 65536])])],
            true,
            "xattr value is 65536 bytes, longer than the 65535 an EROFS image holds",
        ),
        (
            "xattrs4x65535",
            vec![with_xattrs(
                file("c", b"c"),
                &[
                    ("user.a", vec![1; 65535]),
                    ("user.b", vec![2; 65535]),
                    ("user.c", vec![3; 65535]),
                    ("user.d", vec![4; 65535]),
                ],
            )],
            true,
            "an inode may use",
        ),
        (
            "nested2049",
            dirs_down_to(&nested(MAX_DEPTH + 1)),
            false,
            "its path is 2049 directories deep, more than the 2048 tilefs reads from an image",
        ),
    ]
}

/// Writes every layer of these tests to `dir` as a seed of the `oci_layer`
/// fuzz target: a tar of the layer below, then one of the layer itself
/// (the target applies what follows the first archive over it). Listed
/// parents of the deepest paths are left implied (they would make seeds
/// of megabytes).
fn write_layer_seeds(dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    let small = |l: &[E]| -> Vec<u8> {
        let listed = |x: &E| x.kind == tar::EntryType::Directory && x.name.starts_with("n/n/n/");
        let (last, parents) = l.split_last().unwrap();
        let kept: Vec<E> = parents.iter().filter(|x| !listed(x)).chain([last]).cloned().collect();
        tar_of(&kept)
    };
    let limits = limit_layers();
    let mut seeds = vec![(
        "limits".to_string(),
        [small(&limits[0].0), small(&limits[1].0)].concat(),
    )];
    let base = small(&limits_base());
    seeds.push(("xattrs".into(), small(&xattr_layer())));
    seeds.push((
        "nested2048".into(),
        small(&[file(&format!("{}/f", nested(MAX_DEPTH)), b"f")]),
    ));
    for (name, layer, _, _) in past_limits() {
        seeds.push((name.to_string(), [base.clone(), small(&layer)].concat()));
    }
    for (name, tar) in seeds {
        fs::write(dir.join(format!("limits-{name}.tar")), tar).unwrap();
    }
}

/// composefs-rs's `cfsctl`, found as the bench finds it: `$CFSCTL`, else
/// on PATH; or why there is none.
fn cfsctl() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("CFSCTL") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("CFSCTL={} is not a file", p.display()))
        };
    }
    let out = Command::new("sh").args(["-c", "command -v cfsctl"]).output().unwrap();
    match String::from_utf8_lossy(&out.stdout).trim() {
        "" => Err(concat!(
            "cfsctl not found: set CFSCTL to composefs-rs's cfsctl ",
            "(`cargo build --release -p composefs-ctl` at v0.9.0), or put it on PATH"
        )
        .into()),
        p => Ok(PathBuf::from(p)),
    }
}

/// What composefs-rs makes of the image `name` of `layout`, in the
/// `fsverity-sha256-12` repository `repo`: its digest, or its error.
fn composefs_rs_digest(cfsctl: &Path, repo: &Path, layout: &Path, name: &str, xattrs: &str) -> Result<String, String> {
    let run = |args: &[&std::ffi::OsStr]| {
        let out = Command::new(cfsctl).args(args).output().unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(stderr(&out).trim().to_string())
        }
    };
    if !repo.exists() {
        let init = ["init", "--algorithm", "fsverity-sha256-12", "--insecure"];
        let mut args: Vec<&std::ffi::OsStr> = init.iter().map(|s| os(s)).collect();
        args.push(repo.as_os_str());
        run(&args).expect("cfsctl init");
    }
    let oci = |args: &[&str]| {
        let mut all = vec![os("--repo"), repo.as_os_str(), os("oci")];
        all.extend(args.iter().map(|s| os(s)));
        run(&all)
    };
    oci(&["pull", &format!("oci:{}:{name}", layout.display()), name])?;
    oci(&["compute-id", "--xattrs", xattrs, name])
}

/// One file as `find` shows it.
#[derive(Debug, Clone, PartialEq)]
struct Found {
    kind: char,
    nlink: u64,
    ino: u64,
    target: String,
}

/// Everything under `mnt` as `find` lists it (it walks trees deeper than
/// PATH_MAX), by path relative to `mnt`.
fn find_all(mnt: &Path) -> BTreeMap<String, Found> {
    let out = Command::new("find")
        .arg(mnt)
        .args(["-mindepth", "1", "-printf", "%P\\0%y\\0%n\\0%i\\0%l\\0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "find: {}", stderr(&out));
    let fields: Vec<String> = out
        .stdout
        .split(|&b| b == 0)
        .map(|f| String::from_utf8(f.to_vec()).unwrap())
        .collect();
    fields
        .chunks_exact(5)
        .map(|c| {
            let found = Found {
                kind: c[1].chars().next().unwrap(),
                nlink: c[2].parse().unwrap(),
                ino: c[3].parse().unwrap(),
                target: c[4].clone(),
            };
            (c[0].clone(), found)
        })
        .collect()
}

/// What `look` sees of the image `tag` of `store`, mounted at `mnt`.
fn look_at<T>(store: &Path, tag: &str, mnt: &Path, look: impl FnOnce(&Path) -> T) -> T {
    tilefs(&[os("mount"), os("--store"), store.as_os_str(), os(tag), mnt.as_os_str()]);
    let guard = Mounted(mnt.to_path_buf());
    let seen = look(mnt);
    tilefs(&[os("umount"), mnt.as_os_str()]);
    drop(guard);
    seen
}

/// The tar member name of `x`, as the layer gives it.
fn member_name(x: &E) -> String {
    x.pax
        .iter()
        .find(|(k, _)| k == "path")
        .map_or_else(|| x.name.clone(), |(_, v)| String::from_utf8(v.clone()).unwrap())
}

#[test]
fn names_and_paths_at_their_limits_pull_as_composefs_rs_pulls_them() {
    if let Some(dir) = std::env::var_os("TILEFS_WRITE_LAYER_SEEDS") {
        write_layer_seeds(Path::new(&dir));
        return;
    }
    let area = Area::new();
    let layout = area.path("layout");
    let layers = limit_layers();
    let refs: Vec<(&[E], Comp)> = layers.iter().map(|(l, c)| (l.as_slice(), *c)).collect();
    write_image(&layout, "limits", &refs);
    let deepest = nested(MAX_DEPTH);
    let nested_layer = [
        vec![dir("usr")],
        dirs_down_to(&deepest),
        vec![file(&format!("{deepest}/f"), b"f")],
    ]
    .concat();
    write_image(&layout, "nested", &[(&nested_layer, Comp::Gzip)]);
    write_image(&layout, "xattrs", &[(&xattr_layer(), Comp::Gzip)]);
    let store = area.path("store");
    let reference = |name: &str| format!("oci:{}:{name}", layout.display());
    let images = [
        (
            "limits",
            pull(&store, &reference("limits"), &["--tag", "limits"]),
            "allowlist-only",
        ),
        (
            "nested",
            pull(&store, &reference("nested"), &["--tag", "nested"]),
            "allowlist-only",
        ),
        // Only user.* and security.capability xattrs: what composefs-rs
        // keeps with keep-user-xattrs, tilefs with --all-xattrs.
        (
            "xattrs",
            pull(&store, &reference("xattrs"), &["--tag", "xattrs", "--all-xattrs"]),
            "keep-user-xattrs",
        ),
    ];
    match cfsctl() {
        Err(why) => eprintln!("NOT compared with composefs-rs: {why}"),
        Ok(cfsctl) => {
            for (name, digest, xattrs) in &images {
                let theirs = composefs_rs_digest(&cfsctl, &area.path("cfs"), &layout, name, xattrs)
                    .unwrap_or_else(|e| panic!("composefs-rs refused {name}: {e}"));
                assert_eq!(digest, &theirs, "{name}: not the image composefs-rs makes");
            }
            eprintln!(
                "compared with composefs-rs ({}): {} images, the same digests",
                cfsctl.display(),
                images.len()
            );
        }
    }
    assert_fsck_clean(&store);

    // What a user sees.
    require(cannot_mount("erofs"));
    let mnt = area.dir("mnt");
    let seen = look_at(&store, "limits", &mnt, find_all);
    let names_in = |dir: &str| -> Vec<String> {
        let prefix = format!("{dir}/");
        let mut v: Vec<String> = seen
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix).filter(|rest| !rest.contains('/')))
            .map(|n| n.split('x').next().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    // The 252- to 255-byte names and the directory are whited out, the
    // opaque directory holds only what its own layer put there.
    assert_eq!(names_in("d"), ["kept-", "link-", "opaque-"]);
    let opaque = format!("d/{}", long("opaque-", 255));
    assert_eq!(names_in(&opaque), ["b"]);
    let deep = deep_dir();
    assert!(deep.len() > 4096, "a path past PATH_MAX");
    assert_eq!(names_in(&deep), ["file-", "link-"]);
    let at = |p: &str| {
        seen.get(p)
            .unwrap_or_else(|| panic!("{p} missing from the mount"))
            .clone()
    };
    // Hardlinks across paths past PATH_MAX share their inode.
    let (file, kept) = (
        format!("{deep}/{}", long("file-", 255)),
        format!("d/{}", long("kept-", 255)),
    );
    assert_eq!(at(&file), at(&format!("d/{}", long("link-", 255))));
    assert_eq!(at(&kept), at(&format!("{deep}/{}", long("link-", 255))));
    assert_eq!((at(&file).kind, at(&file).nlink), ('f', 2));
    assert_eq!((at(&kept).kind, at(&kept).nlink), ('f', 2));
    assert_eq!(
        (at("s4095").kind, at("s4095").target),
        ('l', "/t".repeat(2048)[..4095].to_string())
    );
    assert_eq!(at("p4095").target, "p".repeat(4095));
    assert_eq!(at("cap").kind, 'f');

    let seen = look_at(&store, "nested", &mnt, find_all);
    assert_eq!(seen.get(&format!("{deepest}/f")).map(|s| s.kind), Some('f'));
    assert_eq!(seen.len(), MAX_DEPTH + 2, "usr, the directories and f");

    let (x, big, f) = look_at(&store, "xattrs", &mnt, |mnt| {
        let f = fs::read(mnt.join("big/f")).unwrap();
        (xattrs(&mnt.join("x")), xattrs(&mnt.join("big")), f)
    });
    assert_eq!(
        x.get(std::ffi::OsStr::new(&long("user.", 255))).map(Vec::as_slice),
        Some(&b"longest name"[..])
    );
    assert_eq!(x.get(std::ffi::OsStr::new("user.big")), Some(&vec![b'v'; 65535]));
    for c in b'a'..=b'c' {
        assert_eq!(
            big.get(std::ffi::OsStr::new(&format!("user.{}", c as char))),
            Some(&vec![c; 65535])
        );
    }
    assert_eq!(f, b"f");
}

#[test]
fn layers_past_a_limit_are_refused_naming_it() {
    let area = Area::new();
    let layout = area.path("layout");
    let base = limits_base();
    let cases = past_limits();
    for (name, layer, _, _) in &cases {
        write_image(&layout, name, &[(&base, Comp::Gzip), (layer, Comp::Gzip)]);
    }
    let store = area.path("store");
    let peer = cfsctl();
    if let Err(why) = &peer {
        eprintln!("NOT compared with composefs-rs: {why}");
    }
    let reference = |name: &str| format!("oci:{}:{name}", layout.display());
    let mut pulled = Vec::new();
    for (name, layer, all_xattrs, why) in &cases {
        let blob = sha256_hex(&compress(&tar_of(layer), Comp::Gzip).0);
        let entry = member_name(layer.last().unwrap());
        let extra: &[&str] = if *all_xattrs { &["--all-xattrs"] } else { &[] };
        let err = fails(&store, &reference(name), extra);
        let head = format!("layer sha256:{blob}: {entry}: ");
        assert!(
            err.contains(&head) && err.contains(why),
            "{name}: want {head}...{why}, got: {err}"
        );
        // Where composefs-rs takes the layer, say what it makes of it.
        let theirs = peer
            .as_ref()
            .ok()
            .map(|c| composefs_rs_digest(c, &area.path("cfs"), &layout, name, "allowlist-only"));
        if *all_xattrs {
            // Without --all-xattrs the xattr past its limit is dropped,
            // as composefs-rs drops it: the same image.
            let digest = pull(&store, &reference(name), &["--tag", name]);
            if let Some(theirs) = theirs {
                assert_eq!(Ok(digest), theirs, "{name}: not the image composefs-rs makes");
            }
            pulled.push(name.to_string());
        } else if let Some(theirs) = theirs {
            eprintln!(
                "{name}: tilefs refuses it; composefs-rs {}",
                match theirs {
                    Ok(d) => format!("makes {d}"),
                    Err(e) => format!("refuses it: {}", e.lines().next().unwrap_or("")),
                }
            );
        }
    }
    let mut tags = tags_in(&store);
    tags.sort();
    pulled.sort();
    assert_eq!(tags, pulled, "only the images without a limit passed are tagged");
    assert_fsck_clean(&store);
}

// ---- hostile registries and layers ---------------------------------------
//
// What a registry or a layer sends is untrusted: none of it may take a
// pull to more memory or time than it bounds, and a pull stops within a
// second of SIGINT or SIGTERM whatever it is doing.

/// `tilefs pull -q --store STORE EXTRA… REFERENCE`, watched ([`watch`]).
fn watch_pull(store: &Path, reference: &str, extra: &[&str], signal: Option<(&str, Duration)>) -> Watched {
    let mut cmd = Command::new(tilefs_bin());
    cmd.args(["pull", "-q", "--store"])
        .arg(store)
        .args(extra)
        .arg(reference);
    watch(cmd, signal, Duration::from_secs(120))
}

/// A pull that failed (exit 1): its message.
fn failed(w: &Watched) -> String {
    assert_eq!(w.out.status.code(), Some(1), "the pull should fail: {}", stderr(&w.out));
    stderr(&w.out)
}

/// A pull that a signal stopped: "interrupted", exit 130 (as `build`),
/// within a second of the signal, nothing tagged in `store`.
fn assert_stopped(w: &Watched, store: &Path, stage: &str) {
    assert_eq!(
        w.out.status.code(),
        Some(130),
        "{stage}: {} (after {:?})",
        stderr(&w.out),
        w.took
    );
    assert_eq!(stderr(&w.out).trim(), "tilefs: interrupted", "{stage}");
    let after = w.after_signal.expect("the signal was sent");
    assert!(
        after < Duration::from_secs(1),
        "{stage}: ended {after:?} after the signal"
    );
    assert!(tags_in(store).is_empty(), "{stage}: a tag was written");
}

/// A small image (one gzip layer, one 10 KiB file) pushed to `registry` as
/// team/app:v1: its manifest (JSON) from the layout.
fn small_image_in(area: &Area, registry: &Registry) -> serde_json::Value {
    let layout = area.path("small-layout");
    let md = write_image(
        &layout,
        "small",
        &[(&[dir("usr"), file("usr/f", &pattern(10240, 3))], Comp::Gzip)],
    );
    skopeo(&[
        "copy",
        "-q",
        "--dest-tls-verify=false",
        &format!("oci:{}:small", layout.display()),
        &format!("docker://{}/team/app:v1", registry.addr),
    ]);
    let manifest = fs::read(layout.join("blobs/sha256").join(md.trim_start_matches("sha256:"))).unwrap();
    serde_json::from_slice(&manifest).unwrap()
}

#[test]
fn an_endless_manifest_is_refused_at_its_size_cap() {
    let area = Area::new();
    let registry = Registry::start(&area);
    small_image_in(&area, &registry);
    // Manifests stream forever, as fast as loopback takes them.
    let relay = Relay::answering(&registry.addr, |_, path| match path.contains("/manifests/") {
        true => Answer::Endless("application/vnd.oci.image.manifest.v1+json"),
        false => Answer::Forward,
    });
    let store = area.path("store");
    let remote = format!("docker://{}/team/app:v1", relay.addr);
    for extra in [&["--tls-verify=false"][..], &["--tls-verify=false", "--lazy"]] {
        let w = watch_pull(&store, &remote, extra, None);
        let err = failed(&w);
        assert!(
            err.contains(&format!(
                "manifest of {}/team/app:v1: larger than 4 MiB (the limit)",
                relay.addr
            )),
            "{extra:?}: {err}"
        );
        // Before: 19 GB of memory in 60 s, until --timeout ended it.
        assert!(w.peak_mib < 150, "{extra:?}: {} MiB", w.peak_mib);
        assert!(w.took < Duration::from_secs(10), "{extra:?}: {:?}", w.took);
    }
    assert!(tags_in(&store).is_empty());
}

#[test]
fn a_registry_that_drips_fails_at_the_least_rate() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let manifest = small_image_in(&area, &registry);
    let layer = manifest["layers"][0]["digest"].as_str().unwrap().to_string();
    let size = manifest["layers"][0]["size"].as_u64().unwrap();
    // The layer comes a byte a second (after its headers, at once).
    let drip = layer.clone();
    let relay = Relay::answering(&registry.addr, move |_, path| match path.ends_with(&drip) {
        true => Answer::Drip {
            len: size,
            per_second: 1,
        },
        false => Answer::Forward,
    });
    let store = area.path("store");
    let remote = format!("docker://{}/team/app:v1", relay.addr);
    let w = watch_pull(&store, &remote, &["--tls-verify=false", "--timeout", "3"], None);
    let err = failed(&w);
    assert!(
        err.contains(&format!("blob {layer}: registry {}: ", relay.addr))
            && err.contains("in 3 s, less than 1024 bytes/s (--min-rate)"),
        "{err}"
    );
    // Before: no end (--timeout applied only between bytes).
    assert!(w.took < Duration::from_secs(10), "{:?}", w.took);
    // A manifest must come whole within --timeout, however fast it comes.
    let relay = Relay::answering(&registry.addr, |_, path| match path.contains("/manifests/") {
        true => Answer::Drip {
            len: 64 << 10,
            per_second: 4096,
        },
        false => Answer::Forward,
    });
    let remote = format!("docker://{}/team/app:v1", relay.addr);
    let w = watch_pull(&store, &remote, &["--tls-verify=false", "--timeout", "2"], None);
    let err = failed(&w);
    assert!(err.contains("not complete within 2 s (--timeout;"), "{err}");
    assert!(w.took < Duration::from_secs(6), "{:?}", w.took);
    assert!(tags_in(&store).is_empty());
}

#[test]
fn a_manifest_naming_one_blob_20000_times_fetches_it_once() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let manifest = small_image_in(&area, &registry);
    let layer = manifest["layers"][0].clone();
    let digest = layer["digest"].as_str().unwrap().to_string();
    let store = area.path("store");
    let once = pull(
        &store,
        &format!("docker://{}/team/app:v1", registry.addr),
        &["--tls-verify=false"],
    );
    // The same image, its layer listed 20,000 times (as its configuration's
    // diff ids are): a registry that serves such a manifest.
    let config = fs::read(
        area.path("small-layout/blobs/sha256").join(
            manifest["config"]["digest"]
                .as_str()
                .unwrap()
                .trim_start_matches("sha256:"),
        ),
    )
    .unwrap();
    let mut config: serde_json::Value = serde_json::from_slice(&config).unwrap();
    let diff = config["rootfs"]["diff_ids"][0].clone();
    config["rootfs"]["diff_ids"] = serde_json::Value::Array(vec![diff; 20_000]);
    let config = config.to_string().into_bytes();
    let config_digest = format!("sha256:{}", sha256_hex(&config));
    let mut many = manifest.clone();
    many["config"]["digest"] = config_digest.clone().into();
    many["config"]["size"] = config.len().into();
    many["layers"] = serde_json::Value::Array(vec![layer; 20_000]);
    let many = many.to_string().into_bytes();
    assert!(many.len() < 4 << 20);
    let relay = Relay::answering(&registry.addr, move |_, path| {
        if path.ends_with("/manifests/many") {
            Answer::Body("application/vnd.oci.image.manifest.v1+json", many.clone())
        } else if path.ends_with(&config_digest) {
            Answer::Body("application/octet-stream", config.clone())
        } else {
            Answer::Forward
        }
    });
    let fresh = area.path("fresh");
    let before = registry.blobs_sent().len();
    let w = watch_pull(
        &fresh,
        &format!("docker://{}/team/app:many", relay.addr),
        &["--tls-verify=false"],
        None,
    );
    assert!(w.out.status.success(), "{}", stderr(&w.out));
    // The same tree: a layer applied over itself changes nothing.
    assert_eq!(String::from_utf8_lossy(&w.out.stdout).trim(), once);
    let sent: Vec<String> = registry.blobs_sent()[before..].to_vec();
    assert_eq!(sent, [digest], "each distinct blob is fetched once");
    // Before: 20,000 fetches and 81 s.
    assert!(w.took < Duration::from_secs(30), "{:?}", w.took);
}

/// Issue 43: a registry's token server is read as any other answer: one
/// that streams forever is refused at 1 MiB, one that never answers fails
/// at --timeout, and SIGINT stops a pull waiting for it.
#[test]
fn a_token_server_that_streams_forever_is_refused_at_its_cap() {
    let area = Area::new();
    let registry = Registry::start(&area);
    small_image_in(&area, &registry);
    let store = area.path("store");
    // A token server that answers: the pull (and a push) ask it for the
    // repository's scope and go on with the token.
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log = asked.clone();
    let tokens = Relay::answering(&registry.addr, move |_, path| {
        log.lock().unwrap().push(path.to_string());
        Answer::Body("application/json", br#"{"token":"t0ken"}"#.to_vec())
    });
    let realm = format!("Bearer realm=\"http://{}/token\",service=\"registry\"", tokens.addr);
    let relay = Relay::answering(&registry.addr, move |_, path| match path {
        "/v2/" => Answer::Challenge(realm.clone()),
        _ => Answer::Forward,
    });
    let good = area.path("good");
    pull(
        &good,
        &format!("docker://{}/team/app:v1", relay.addr),
        &["--tls-verify=false", "--tag", "app"],
    );
    common::oci::push(&good, "app", &format!("docker://{}/team/copy:v1", relay.addr));
    let asked = asked.lock().unwrap().clone();
    let scope = |s: &str| asked.iter().any(|p| p.starts_with("/token?") && p.contains(s));
    assert!(
        scope("scope=repository%3Ateam%2Fapp%3Apull") && scope("scope=repository%3Ateam%2Fcopy%3Apull%2Cpush"),
        "{asked:?}"
    );
    for stage in ["endless", "stall"] {
        let tokens = Relay::answering(&registry.addr, move |_, _| match stage {
            "endless" => Answer::Endless("application/json"),
            _ => Answer::Stall,
        });
        // The registry asks for a Bearer token from that server.
        let realm = format!("Bearer realm=\"http://{}/token\",service=\"registry\"", tokens.addr);
        let relay = Relay::answering(&registry.addr, move |_, path| match path {
            "/v2/" => Answer::Challenge(realm.clone()),
            _ => Answer::Forward,
        });
        let remote = format!("docker://{}/team/app:v1", relay.addr);
        let w = watch_pull(&store, &remote, &["--tls-verify=false", "--timeout", "2"], None);
        let err = failed(&w);
        let why = match stage {
            "endless" => format!(
                "authentication failed: the token server http://{}/token: its answer passes 1 MiB (the limit)",
                tokens.addr
            ),
            _ => "no answer within 2 s (--timeout".to_string(),
        };
        assert!(
            err.contains(&format!("registry {}", relay.addr)) && err.contains(&why),
            "{stage}: {err}"
        );
        // Before: the whole answer read into memory until --timeout.
        assert!(w.peak_mib < 150, "{stage}: {} MiB", w.peak_mib);
        assert!(w.took < Duration::from_secs(10), "{stage}: {:?}", w.took);
        if stage == "stall" {
            let w = watch_pull(
                &store,
                &remote,
                &["--tls-verify=false"],
                Some(("INT", Duration::from_secs(1))),
            );
            assert_stopped(&w, &store, "SIGINT waiting for a token");
        }
    }
    assert!(tags_in(&store).is_empty());
}

#[test]
fn a_redirect_to_a_file_url_is_refused_saying_so() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let manifest = small_image_in(&area, &registry);
    let layer = manifest["layers"][0]["digest"].as_str().unwrap().to_string();
    let to = layer.clone();
    let relay = Relay::answering(&registry.addr, move |_, path| match path.ends_with(&to) {
        true => Answer::Redirect("file:///etc/passwd".into()),
        false => Answer::Forward,
    });
    let store = area.path("store");
    let err = fails(
        &store,
        &format!("docker://{}/team/app:v1", relay.addr),
        &["--tls-verify=false"],
    );
    // Before: "0 bytes where its descriptor states 10240".
    assert!(
        err.contains(&format!("blob {layer}: registry {}: HTTP 302 Found", relay.addr))
            && err.contains("a redirect to \"file:///etc/passwd\", not followed (only HTTP(S) redirects are)"),
        "{err}"
    );
    assert!(tags_in(&store).is_empty());
}

/// A PAX sparse file (format 1.0, as GNU tar writes it) of `size` bytes
/// holding one byte, at its end.
fn pax_sparse(name: &str, size: u64) -> E {
    pax_sparse_of(name, size, &[(size - 1, b"x".to_vec())])
}

/// A PAX sparse file (format 1.0) of `size` bytes holding `pieces`
/// (offset, data), the rest holes.
fn pax_sparse_of(name: &str, size: u64, pieces: &[(u64, Vec<u8>)]) -> E {
    let mut data = format!("{}\n", pieces.len()).into_bytes();
    for (off, d) in pieces {
        data.extend_from_slice(format!("{off}\n{}\n", d.len()).as_bytes());
    }
    data.resize(data.len().next_multiple_of(512), 0);
    for (_, d) in pieces {
        data.extend_from_slice(d);
    }
    E {
        pax: vec![
            ("GNU.sparse.major".into(), b"1".to_vec()),
            ("GNU.sparse.minor".into(), b"0".to_vec()),
            ("GNU.sparse.name".into(), name.as_bytes().to_vec()),
            ("GNU.sparse.realsize".into(), size.to_string().into_bytes()),
        ],
        data,
        ..file(&format!("GNUSparseFile.0/{name}"), b"")
    }
}

/// A layer of one old GNU sparse entry (type `S`) of `size` bytes holding
/// one byte, at its end.
fn gnu_sparse_layer(name: &str, size: u64) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.set_path(name).unwrap();
    h.set_entry_type(tar::EntryType::GNUSparse);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(1);
    let gnu = h.as_gnu_mut().unwrap();
    gnu.set_real_size(size);
    gnu.sparse[0].set_offset(size - 1);
    gnu.sparse[0].set_length(1);
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, &b"x"[..]).unwrap();
    b.into_inner().unwrap()
}

/// A layer whose first entry has a GNU long name of `len` bytes.
fn long_name_layer(len: usize) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"././@LongLink");
    h.set_entry_type(tar::EntryType::GNULongName);
    h.set_mode(0o644);
    h.set_size(len as u64);
    h.set_cksum();
    let mut tar = h.as_bytes().to_vec();
    tar.resize(512 + len.next_multiple_of(512), b'n');
    tar.extend_from_slice(&tar_of(&[file("f", b"x")]));
    tar
}

#[test]
fn layers_that_declare_far_more_than_they_hold_are_refused() {
    let area = Area::new();
    let layout = area.path("layout");
    let tib10 = 10u64 << 40;
    let blob = |tar: Vec<u8>| {
        let diff = format!("sha256:{}", sha256_hex(&tar));
        let (blob, mt) = compress(&tar, Comp::Gzip);
        (blob, mt, diff)
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "pax-sparse",
            tar_of(&[pax_sparse("disk", tib10)]),
            "disk: a sparse file of 10995116277760 bytes, 10995116277759 of them holes: more than the 64 GiB of holes a pull expands",
        ),
        (
            "gnu-sparse",
            gnu_sparse_layer("disk", tib10),
            "disk: a sparse file of 10995116277760 bytes, 10995116277759 of them holes: more than the 64 GiB",
        ),
        (
            "long-name",
            long_name_layer(256 << 20),
            "entry 1: unreadable tar header: the entry's headers (long names, PAX records) pass 16 MiB (the limit)",
        ),
        (
            "big-pax-record",
            tar_of(&[E {
                pax: vec![("SCHILY.xattr.user.x".into(), vec![b'v'; 32 << 20])],
                ..file("f", b"x")
            }]),
            "pass 16 MiB (the limit)",
        ),
    ];
    // Holes over several files and layers add up.
    let half = 40u64 << 30;
    let two = [tar_of(&[pax_sparse("a", half)]), tar_of(&[pax_sparse("b", half)])];
    for (name, tar, _) in &cases {
        write_image_blobs(&layout, name, &[blob(tar.clone())]);
    }
    write_image_blobs(&layout, "two-layers", &[blob(two[0].clone()), blob(two[1].clone())]);
    let store = area.path("store");
    for (name, tar, why) in &cases {
        let w = watch_pull(&store, &format!("oci:{}:{name}", layout.display()), &[], None);
        let err = failed(&w);
        assert!(err.contains(why) && err.contains("layer sha256:"), "{name}: {err}");
        // Before: a sparse file hashed for hours (10 TiB at ~1 GiB/s); a
        // 256 MiB long name took 1.5 GB of memory (a 1 GiB one, 5.7 GB).
        assert!(w.took < Duration::from_secs(10), "{name}: {:?}", w.took);
        assert!(
            w.peak_mib < 150,
            "{name}: {} MiB (a {} byte layer)",
            w.peak_mib,
            tar.len()
        );
    }
    let w = watch_pull(&store, &format!("oci:{}:two-layers", layout.display()), &[], None);
    let err = failed(&w);
    assert!(
        err.contains(
            "42949672959 of them holes: more than the 25769803777 bytes left of the 64 GiB of holes a pull expands"
        ),
        "{err}"
    );
    assert!(tags_in(&store).is_empty());
    assert_fsck_clean(&store);
}

/// Issue 43: a sparse file costs what it holds, not what it declares: a
/// layer whose PAX sparse file declares 60 GiB holding 12 KiB pulls into an
/// object that holds only that on disk (its holes neither read, hashed
/// block by block nor written), named by the fs-verity digest of the file
/// it stands for, and read back with its data at its offsets.
#[test]
fn a_sparse_file_costs_its_data_not_its_size() {
    let area = Area::new();
    let size = 60u64 << 30;
    let pieces: Vec<(u64, Vec<u8>)> = [0, (5 << 30) + 123, 40 << 30, size - 3000]
        .into_iter()
        .zip(1u8..)
        .map(|(off, seed)| (off, pattern(3000, seed)))
        .collect();
    let layout = area.path("layout");
    write_image(
        &layout,
        "disk",
        &[(&[pax_sparse_of("disk", size, &pieces)], Comp::Gzip)],
    );
    let store = area.path("store");
    let w = watch_pull(
        &store,
        &format!("oci:{}:disk", layout.display()),
        &["--tag", "disk"],
        None,
    );
    assert!(w.out.status.success(), "{}", stderr(&w.out));
    // Before: 47 s, hashing 60 GiB of zeros (0.7 s of CPU per GiB).
    assert!(w.took < Duration::from_secs(20), "{:?}", w.took);

    // The same file made by hand, digested as `fsverity digest` does.
    let by_hand = area.path("by-hand");
    let f = fs::File::create(&by_hand).unwrap();
    f.set_len(size).unwrap();
    for (off, d) in &pieces {
        std::os::unix::fs::FileExt::write_all_at(&f, d, *off).unwrap();
    }
    drop(f);
    let out = String::from_utf8_lossy(&tilefs(&[os("digest"), by_hand.as_os_str()]).stdout).into_owned();
    let want = out
        .split_whitespace()
        .next()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let object = store.join(format!("{}/{}", &want[..2], &want[2..]));
    let meta = fs::metadata(&object).unwrap_or_else(|e| panic!("{}: {e}", object.display()));
    assert_eq!(meta.len(), size);
    // Four pieces of data: a few blocks on disk, not 60 GiB.
    assert!(meta.blocks() * 512 <= 1 << 20, "{} bytes on disk", meta.blocks() * 512);
    assert_fsck_clean(&store);

    let mnt = area.path("mnt");
    let (_mounted, _) = common::oci::mount_tag(&store, "disk", &mnt, &area.path("mount.log"));
    let f = fs::File::open(mnt.join("disk")).unwrap();
    assert_eq!(f.metadata().unwrap().len(), size);
    let at = |off: u64, len: usize| {
        let mut buf = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, off).unwrap();
        buf
    };
    for (off, d) in &pieces {
        assert_eq!(&at(*off, d.len()), d, "data at {off}");
        if *off > 0 {
            assert_eq!(at(off - 4096, 4096), vec![0u8; 4096], "zeros before {off}");
        }
    }
    assert_eq!(at(30 << 30, 1 << 20), vec![0u8; 1 << 20], "zeros at 30 GiB");
}

#[test]
fn sigint_and_sigterm_stop_a_pull_within_a_second_in_every_stage() {
    let area = Area::new();
    // Reading a layer whose old GNU sparse file of 60 GiB (within the
    // limit) the tar reader expands into zeros, many seconds' work (a PAX
    // sparse file's holes are never read).
    let layout = area.path("layout");
    let tar = gnu_sparse_layer("disk", 60 << 30);
    let diff = format!("sha256:{}", sha256_hex(&tar));
    let (blob, mt) = compress(&tar, Comp::Gzip);
    write_image_blobs(&layout, "sparse", &[(blob, mt, diff)]);
    let store = area.path("store");
    let sparse = format!("oci:{}:sparse", layout.display());
    for sig in ["INT", "TERM"] {
        let w = watch_pull(&store, &sparse, &[], Some((sig, Duration::from_secs(1))));
        assert_stopped(&w, &store, &format!("SIG{sig} while reading zeros"));
    }
    // Fetching the manifest from a registry that does not answer, and
    // reading a layer that comes a byte a second (no --min-rate).
    let registry = Registry::start(&area);
    let manifest = small_image_in(&area, &registry);
    let layer = manifest["layers"][0]["digest"].as_str().unwrap().to_string();
    let relay = Relay::answering(&registry.addr, move |_, path| {
        if path.contains("/manifests/stall") {
            Answer::Stall
        } else if path.ends_with(&layer) {
            Answer::Drip {
                len: 1 << 20,
                per_second: 1,
            }
        } else {
            Answer::Forward
        }
    });
    let base = format!("docker://{}/team/app", relay.addr);
    for (reference, stage) in [("stall", "fetching the manifest"), ("v1", "reading a layer")] {
        for sig in ["INT", "TERM"] {
            let w = watch_pull(
                &store,
                &format!("{base}:{reference}"),
                &["--tls-verify=false", "--min-rate", "0"],
                Some((sig, Duration::from_millis(1500))),
            );
            assert_stopped(&w, &store, &format!("SIG{sig} {stage}"));
        }
    }
    assert_fsck_clean(&store);
}
