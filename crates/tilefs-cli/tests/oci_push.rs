//! `tilefs push`, incremental pulls and lazy pulls against a real registry
//! (Debian's docker-registry on loopback): what goes over the wire is read
//! from the registry's access log, faults come from its own storage being
//! tampered with, from indexes uploaded by hand, and from a TCP proxy that
//! cuts or stalls the connection.

mod common;

use common::oci::*;
use common::registry::{Answer, End, Pass, Registry, Relay};
use common::*;
use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

// ---- a TCP proxy that cuts or stalls ---------------------------------------

/// A relay to `upstream` that, once `budget` bytes have gone downstream
/// (over all connections), cuts every connection (`stall` false) or stops
/// forwarding and holds them open (`stall`).
fn proxy(upstream: &str, budget: u64, stall: bool) -> Relay {
    let sent = AtomicU64::new(0);
    Relay::start(upstream, move |chunk, _| {
        let n = chunk.len();
        let before = sent.fetch_add(n as u64, Relaxed);
        let allowed = budget.saturating_sub(before).min(n as u64) as usize;
        match (allowed < n, stall) {
            (false, _) => Pass::All,
            (true, false) => Pass::Then(allowed, End::Cut),
            (true, true) => Pass::Then(allowed, End::Stall),
        }
    })
}

// ---- tests -----------------------------------------------------------------

#[test]
fn push_and_pull_give_the_same_image_and_send_nothing_twice() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    tree(&src, 1, 30, 100 << 10);
    write_files(&src, 2, &[("big/one-mib".into(), 1 << 20)]);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);

    let first = push(&store, "app", &remote);
    assert_eq!(first["digest"], digest.as_str());
    assert_eq!(first["blobs_uploaded"], first["blobs"], "{first}");

    // A standard OCI manifest: the artifact's media types, as documented.
    let m = skopeo_raw(&remote);
    assert_eq!(m["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(m["artifactType"], "application/vnd.tilefs.image.v1");
    assert_eq!(m["config"]["mediaType"], "application/vnd.tilefs.image.config.v1+json");
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers[0]["mediaType"], "application/vnd.tilefs.image.tree.v3");
    assert_eq!(layers[0]["annotations"]["org.tilefs.fsverity"], digest.as_str());
    assert_eq!(
        layers_of(&m, "tree").len() + layers_of(&m, "pack").len(),
        layers.len(),
        "tree chunks, then packs"
    );
    assert!(layers
        .last()
        .is_some_and(|l| l["mediaType"] == "application/vnd.tilefs.image.pack.v2"));
    assert_eq!(
        format!("sha256:{}", sha256_hex(&manifest_bytes(&registry, "team/app", "v1"))),
        first["manifest_digest"].as_str().unwrap()
    );

    // Pulled into another store: the same image, byte for byte, whole.
    let other = area.path("other");
    assert_eq!(pull(&other, &remote, &[]), digest);
    assert!(fsck_text(&other).contains("clean"));
    let built_image = fs::read(store.join("images/app")).unwrap();
    let tag = format!("{}_team_app:v1", registry.addr);
    assert_eq!(fs::read(other.join("images").join(&tag)).unwrap(), built_image);
    if cannot_mount("erofs").is_none() {
        let mnt = area.dir("mnt");
        tilefs(&[
            os("mount"),
            os("--kernel"),
            os("--store"),
            other.as_os_str(),
            os(&tag),
            mnt.as_os_str(),
        ]);
        let _guard = Mounted(mnt.clone());
        assert_same_contents(&src, &mnt, &scan(&src));
    }

    // Pushing again sends no blob; to another repository, blobs are mounted.
    let before = registry.requests().len();
    let again = push(&store, "app", &remote);
    assert_eq!(again["blobs_present"], again["blobs"], "{again}");
    let uploads = |from: usize| {
        registry.requests()[from..]
            .iter()
            .filter(|q| q.path.contains("/blobs/uploads/") && q.method != "POST")
            .count()
    };
    assert_eq!(uploads(before), 0, "no blob upload when the repository has them");
    let before = registry.requests().len();
    let moved = push(&store, "app", &format!("docker://{}/elsewhere/app:v1", registry.addr));
    assert_eq!(moved["blobs_mounted"], moved["blobs"], "{moved}");
    assert_eq!(moved["bytes_uploaded"], 0);
    assert_eq!(uploads(before), 0, "mounted, not uploaded");

    // Any OCI tool can copy the artifact; the copy pulls the same.
    let copied = format!("docker://{}/copy/app:v1", registry.addr);
    let out = Command::new("skopeo")
        .args([
            "copy",
            "-q",
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
            &remote,
            &copied,
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "skopeo copy: {}", stderr(&out));
    assert_eq!(pull(&area.path("third"), &copied, &[]), digest);
    // And into an OCI layout, pulled from there by range too.
    let layout = area.path("layout");
    let out = Command::new("skopeo")
        .args(["copy", "-q", "--src-tls-verify=false", &remote])
        .arg(format!("oci:{}:app", layout.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "skopeo copy to a layout: {}", stderr(&out));
    assert_eq!(
        pull(&area.path("fourth"), &format!("oci:{}:app", layout.display()), &[]),
        digest
    );
}

fn manifest_bytes(r: &Registry, repo: &str, tag: &str) -> Vec<u8> {
    let out = Command::new("curl")
        .args(["-sf", "-H", "Accept: application/vnd.oci.image.manifest.v1+json"])
        .arg(format!("http://{}/v2/{repo}/manifests/{tag}", r.addr))
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

#[test]
fn a_second_image_sharing_most_objects_transfers_only_what_is_new() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    let files = tree(&src, 3, 100, 64 << 10);
    let store = area.path("store");
    build_tag(&store, "v1", &src);
    // Ten of the hundred files change.
    let changed: Vec<(String, usize)> = files.iter().step_by(10).cloned().collect();
    write_files(&src, 4, &changed);
    let v2 = build_tag(&store, "v2", &src);
    let base = format!("docker://{}/team/app", registry.addr);
    push(&store, "v1", &format!("{base}:v1"));
    let second = push(&store, "v2", &format!("{base}:v2"));
    assert!(second["blobs_uploaded"].as_u64().unwrap() >= 1);

    let pulled = area.path("pulled");
    let n = registry.requests().len();
    pull(&pulled, &format!("{base}:v1"), &[]);
    let first_bytes = blob_bytes_since(&registry, n);
    let n = registry.requests().len();
    assert_eq!(pull(&pulled, &format!("{base}:v2"), &[]), v2);
    let second_bytes = blob_bytes_since(&registry, n);
    assert!(
        second_bytes * 10 <= first_bytes * 3,
        "second pull sent {second_bytes} bytes, first {first_bytes}: more than 30%"
    );
    // The objects sent are about the ten changed files (plus image and index).
    assert!(second_bytes >= 10 * (64 << 10), "{second_bytes}");
    assert!(fsck_text(&pulled).contains("clean"));
    assert_eq!(
        fs::read(pulled.join("images").join(format!("{}_team_app:v2", registry.addr))).unwrap(),
        fs::read(store.join("images/v2")).unwrap()
    );
}

#[test]
fn a_lazy_pull_fetches_each_object_on_first_read() {
    require(cannot_fuse());
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    tree(&src, 5, 40, 256 << 10);
    write_files(&src, 6, &[("big/one-mib".into(), 1 << 20)]);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&store, "app", &remote);
    let image_size = fs::metadata(store.join("images/app")).unwrap().len();

    let lazy = area.path("lazy");
    let n = registry.requests().len();
    assert_eq!(pull(&lazy, &remote, &["--lazy"]), digest);
    let sent = blob_bytes_since(&registry, n);
    assert!(
        sent < image_size + (64 << 10),
        "a lazy pull sent {sent} bytes (image {image_size})"
    );
    assert_eq!(objects_in(&lazy), 0);
    let text = fsck_text(&lazy);
    assert!(text.contains("not fetched yet") && text.contains("clean"), "{text}");
    // gc keeps the record of where the objects are while the image is tagged.
    tilefs(&[os("gc"), os("--store"), lazy.as_os_str()]);
    assert_eq!(fs::read_dir(lazy.join(".remote")).unwrap().count(), 1);
    let tag = format!("{}_team_app:v1", registry.addr);

    // (The kernel mount of a lazy image: tests/kernel_lazy.rs.)
    let mnt = area.dir("mnt");
    // Through FUSE, one file read transfers about itself.
    let log = area.path("fuse.log");
    let t = Instant::now();
    let (m, _) = mount_tag(&lazy, &tag, &mnt, &log);
    let n = registry.requests().len();
    let got = read(&mnt.join("big/one-mib")).unwrap();
    eprintln!("mount and first read of 1 MiB: {:?}", t.elapsed());
    assert_eq!(got, fs::read(src.join("big/one-mib")).unwrap());
    let sent = blob_bytes_since(&registry, n);
    assert!(
        (1 << 20..(1 << 20) + (64 << 10)).contains(&sent),
        "reading 1 MiB sent {sent} bytes"
    );
    assert_eq!(objects_in(&lazy), 1);
    // Read again: from the store now.
    let n = registry.requests().len();
    assert_eq!(read(&mnt.join("big/one-mib")).unwrap(), got);
    assert_eq!(blob_bytes_since(&registry, n), 0);
    // Reading the 40 other files in order: a sequential read fetches
    // ahead, so far fewer requests than files.
    let n = registry.requests().len();
    assert_same_contents(&src, &mnt, &scan(&src));
    let gets = registry.requests()[n..]
        .iter()
        .filter(|q| q.method == "GET" && q.path.contains("/blobs/"))
        .count();
    eprintln!("40 files read with {gets} range requests");
    assert!(gets <= 20, "{gets} requests for 40 files read in order");
    drop(m);

    // A full pull completes the store with what is still missing, and the
    // kernel mounts it then.
    let n = registry.requests().len();
    assert_eq!(pull(&lazy, &remote, &[]), digest);
    let rest = blob_bytes_since(&registry, n);
    let total: u64 = 40 * (256 << 10) + (1 << 20);
    assert!(rest < total - (1 << 20) + image_size + (128 << 10), "{rest}");
    let text = fsck_text(&lazy);
    assert!(!text.contains("not fetched"), "{text}");
    if cannot_mount("erofs").is_none() {
        tilefs(&[
            os("mount"),
            os("--kernel"),
            os("--store"),
            lazy.as_os_str(),
            os(&tag),
            mnt.as_os_str(),
        ]);
        let _guard = Mounted(mnt.clone());
        assert_same_contents(&src, &mnt, &scan(&src));
    }
}

/// Uploads `data` as a blob of `repo` with curl (a monolithic upload).
fn upload_blob(r: &Registry, repo: &str, data: &[u8]) -> String {
    let digest = format!("sha256:{}", sha256_hex(data));
    let out = Command::new("curl")
        .args(["-sf", "-D", "-", "-o", "/dev/null", "-X", "POST"])
        .arg(format!("http://{}/v2/{repo}/blobs/uploads/", r.addr))
        .output()
        .unwrap();
    assert!(out.status.success());
    let headers = String::from_utf8_lossy(&out.stdout);
    let location = headers
        .lines()
        .find_map(|l| l.strip_prefix("Location: ").or_else(|| l.strip_prefix("location: ")))
        .unwrap()
        .trim()
        .to_string();
    let sep = if location.contains('?') { '&' } else { '?' };
    let url = if location.starts_with("http") {
        format!("{location}{sep}digest={digest}")
    } else {
        format!("http://{}{location}{sep}digest={digest}", r.addr)
    };
    let mut child = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/octet-stream",
            "--data-binary",
            "@-",
            &url,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    assert!(child.wait().unwrap().success(), "blob upload");
    digest
}

fn put_manifest(r: &Registry, repo: &str, tag: &str, manifest: &[u8]) {
    let mut child = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/vnd.oci.image.manifest.v1+json",
            "--data-binary",
            "@-",
        ])
        .arg(format!("http://{}/v2/{repo}/manifests/{tag}", r.addr))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(manifest).unwrap();
    assert!(child.wait().unwrap().success(), "manifest upload");
}

/// Pushes the image tagged `tag` in `store` (fs-verity digest `digest`)
/// to `repo:rtag` as tilefs did before packs were compressed (artifact
/// format 1, as the README describes it): the image as it is, one pack of
/// the objects as they are, a JSON index.
fn push_format_1(r: &Registry, store: &Path, tag: &str, digest: &str, repo: &str, rtag: &str) {
    let image = fs::read(store.join("images").join(tag)).unwrap();
    let listed = tilefs(&[os("objects"), store.join("images").join(tag).as_os_str()]);
    let mut pack = Vec::new();
    let mut index = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for rel in String::from_utf8_lossy(&listed.stdout).lines() {
        if !seen.insert(rel.to_string()) {
            continue;
        }
        let bytes = fs::read(store.join(rel)).unwrap();
        let hex = rel.replace('/', "");
        index.push(serde_json::json!([hex, 0, pack.len(), bytes.len()]));
        pack.extend_from_slice(&bytes);
    }
    let config = serde_json::to_vec(
        &serde_json::json!({"fsverity": digest, "objects": index.len(), "object_bytes": pack.len()}),
    )
    .unwrap();
    let index = serde_json::to_vec(&serde_json::json!({"version": 1, "objects": index})).unwrap();
    let desc = |t: &str, data: &[u8]| serde_json::json!({"mediaType": t, "digest": upload_blob(r, repo, data), "size": data.len()});
    let mut erofs = desc("application/vnd.tilefs.image.erofs.v1", &image);
    erofs["annotations"] = serde_json::json!({"org.tilefs.fsverity": digest});
    let m = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.tilefs.image.v1",
        "config": desc("application/vnd.tilefs.image.config.v1+json", &config),
        "layers": [
            erofs,
            desc("application/vnd.tilefs.image.objects.v1+json", &index),
            desc("application/vnd.tilefs.image.pack.v1", &pack),
        ],
    });
    put_manifest(r, repo, rtag, &serde_json::to_vec(&m).unwrap());
}

/// An artifact of format 1 (tilefs before packs were compressed) pulls
/// whole and lazily as it did; its JSON index is checked as it was.
#[test]
fn wrong_bytes_and_lying_indexes_store_nothing() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    let files = tree(&src, 7, 20, 100 << 10);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push_format_1(&registry, &store, "app", &digest, "team/app", "v1");
    let whole = area.path("whole");
    assert_eq!(pull(&whole, &remote, &[]), digest);
    assert!(fsck_text(&whole).contains("clean"));

    // An index that says an object lies where another one does: the bytes
    // there are not that object.
    let m = skopeo_raw(&remote);
    let index_digest = m["layers"][1]["digest"].as_str().unwrap().to_string();
    let mut index: serde_json::Value =
        serde_json::from_slice(&fs::read(registry.blob_file(&index_digest)).unwrap()).unwrap();
    let objs = index["objects"].as_array_mut().unwrap();
    let (a, b) = (objs[1][2].clone(), objs[2][2].clone());
    objs[1][2] = b;
    objs[2][2] = a;
    let lying = serde_json::to_vec(&index).unwrap();
    let lying_digest = upload_blob(&registry, "team/app", &lying);
    let mut liar = m.clone();
    liar["layers"][1]["digest"] = lying_digest.into();
    liar["layers"][1]["size"] = lying.len().into();
    put_manifest(&registry, "team/app", "liar", &serde_json::to_vec(&liar).unwrap());
    let s = area.path("s-liar");
    let err = pull_fails(&s, &format!("docker://{}/team/app:liar", registry.addr), &[]);
    eprintln!("liar: {err}");
    assert!(err.contains("does not match its fs-verity digest"), "{err}");
    assert!(err.contains("object "), "names the object: {err}");
    assert!(tags_in(&s).is_empty());
    assert_clean_or_gone(&s);

    // An index placing an object outside its pack is refused before any
    // object is fetched.
    let mut outside = index.clone();
    outside["objects"][0][2] = (1u64 << 40).into();
    let bytes = serde_json::to_vec(&outside).unwrap();
    let d = upload_blob(&registry, "team/app", &bytes);
    let mut m2 = m.clone();
    m2["layers"][1]["digest"] = d.into();
    m2["layers"][1]["size"] = bytes.len().into();
    put_manifest(&registry, "team/app", "outside", &serde_json::to_vec(&m2).unwrap());
    let err = pull_fails(
        &area.path("s-outside"),
        &format!("docker://{}/team/app:outside", registry.addr),
        &["--lazy"],
    );
    assert!(err.contains("outside pack"), "{err}");

    // The registry's own copy of a pack changed: the full pull names the
    // pack and the object, and stores nothing wrong.
    let lazy = area.path("lazy");
    pull(&lazy, &remote, &["--lazy"]);
    let pack = registry.tamper_largest_blob();
    let s = area.path("s-tampered");
    let err = pull_fails(&s, &remote, &[]);
    assert!(
        err.contains(&pack) && err.contains("does not match its fs-verity digest"),
        "{err}"
    );
    assert!(tags_in(&s).is_empty());
    assert_clean_or_gone(&s);

    // Through a lazy mount: that one file fails with EIO and the log names
    // its object; every other file reads.
    require(cannot_fuse());
    let mnt = area.dir("mnt");
    let log = area.path("fuse.log");
    let tag = format!("{}_team_app:v1", registry.addr);
    let (_m, _) = mount_tag(&lazy, &tag, &mnt, &log);
    let mut failed = Vec::new();
    for (name, _) in &files {
        match read(&mnt.join(name)) {
            Ok(got) => assert_eq!(got, fs::read(src.join(name)).unwrap(), "{name}"),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{name}: {e}");
                failed.push(name.clone());
            }
        }
    }
    assert_eq!(failed.len(), 1, "exactly the damaged file fails: {failed:?}");
    let logged = fs::read_to_string(&log).unwrap();
    assert!(logged.contains("does not match its fs-verity digest"), "{logged}");
    assert!(logged.contains(&failed[0]) && logged.contains("object "), "{logged}");
    assert_eq!(objects_in(&lazy), files.len() - 1);
    assert!(fsck_text(&lazy).contains("clean"));
}

#[test]
fn a_registry_that_stops_or_stalls_fails_cleanly_and_a_later_pull_resumes() {
    let area = Area::new();
    let mut registry = Registry::start(&area);
    let src = area.dir("src");
    let files = tree(&src, 9, 40, 256 << 10);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    push(&store, "app", &format!("docker://{}/team/app:v1", registry.addr));
    let image_size = fs::metadata(store.join("images/app")).unwrap().len();

    // The connection is cut after about half the objects, every time: the
    // pull retries (bounded), then fails naming the registry; what came
    // whole is kept, nothing else.
    let cut = proxy(&registry.addr, image_size + (64 << 10) + 5 * (1 << 20), false);
    // A store of its own already (one a failed pull created is removed).
    let s = area.path("s");
    build_tag(&s, "other", &area.dir("empty"));
    let t = Instant::now();
    let err = pull_fails(&s, &format!("docker://{}/team/app:v1", cut.addr), &["--timeout", "5"]);
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
    eprintln!("cut: {err}");
    assert!(err.contains("blob sha256:"), "names the blob: {err}");
    assert_eq!(tags_in(&s), ["other"]);
    assert!(fsck_text(&s).contains("clean"));
    let kept = objects_in(&s);
    assert!(kept > 0 && kept < files.len(), "{kept} objects kept");
    drop(cut);
    // Pulled again (directly): only the rest comes.
    let n = registry.requests().len();
    assert_eq!(
        pull(&s, &format!("docker://{}/team/app:v1", registry.addr), &[]),
        digest
    );
    let rest = blob_bytes_since(&registry, n);
    assert!(
        rest < (files.len() - kept + 2) as u64 * (256 << 10) + image_size + (64 << 10),
        "{rest}"
    );

    // A lazy mount whose registry stalls: a read fails with EIO within the
    // timeout; the mount keeps answering; once the registry is back, the
    // file reads.
    require(cannot_fuse());
    let stall = proxy(&registry.addr, image_size + (256 << 10) + (128 << 10), true);
    let lazy = area.path("lazy");
    pull(
        &lazy,
        &format!("docker://{}/team/app:v1", stall.addr),
        &["--lazy", "--timeout", "2"],
    );
    let tag = format!("{}_team_app:v1", stall.addr);
    let mnt = area.dir("mnt");
    let log = area.path("fuse.log");
    let (_m, _) = mount_tag(&lazy, &tag, &mnt, &log);
    // The first file is served; the proxy then stalls.
    assert_eq!(
        read(&mnt.join(&files[0].0)).unwrap(),
        fs::read(src.join(&files[0].0)).unwrap()
    );
    let t = Instant::now();
    let e = read(&mnt.join(&files[1].0)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "a stalled read took {:?}",
        t.elapsed()
    );
    assert!(
        fs::symlink_metadata(mnt.join("small")).is_ok(),
        "the mount still answers"
    );
    assert_eq!(fs::read(mnt.join("small")).unwrap(), b"inline contents");
    let logged = fs::read_to_string(&log).unwrap();
    eprintln!("stalled: {logged}");
    assert!(logged.contains(&files[1].0), "{logged}");
    assert_eq!(objects_in(&lazy), 1);
    // The registry stops altogether, then comes back.
    drop(stall);
    registry.stop();
    registry.restart();
    assert!(fsck_text(&lazy).contains("clean"));
}

#[test]
fn push_needs_the_registrys_consent_and_a_complete_image() {
    let area = Area::new();
    let auth = area.path("auth.json");
    let registry = Registry::start_with_password(&area, "alice", "s3cret", &auth);
    let src = area.dir("src");
    tree(&src, 11, 5, 10 << 10);
    let store = area.path("store");
    build_tag(&store, "app", &src);
    let remote = format!("docker://{}/private/app:v1", registry.addr);
    let run = |auth: Option<&Path>| {
        let mut c = Command::new(tilefs_bin());
        c.args(["push", "-q", "--tls-verify=false", "--store"])
            .arg(&store)
            .args(["app", &remote]);
        c.env("HOME", area.path("home")).env_remove("XDG_RUNTIME_DIR");
        match auth {
            Some(f) => c.env("REGISTRY_AUTH_FILE", f),
            None => c.env_remove("REGISTRY_AUTH_FILE"),
        };
        c.output().unwrap()
    };
    let refused = run(None);
    assert_eq!(refused.status.code(), Some(1));
    assert!(stderr(&refused).contains(&registry.addr), "{}", stderr(&refused));
    assert!(stderr(&refused).contains("no credentials for"), "{}", stderr(&refused));
    let ok = run(Some(&auth));
    assert!(ok.status.success(), "{}", stderr(&ok));

    // An image whose objects are not all in the store is not pushed.
    let rel = fs::read_dir(&store)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().len() == 2)
        .map(|e| fs::read_dir(e.path()).unwrap().next().unwrap().unwrap().path())
        .unwrap();
    fs::remove_file(&rel).unwrap();
    let out = run(Some(&auth));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("is not in the store"), "{}", stderr(&out));
    // Only registries take pushes.
    let out = tilefs_any(&[
        os("push"),
        os("--store"),
        store.as_os_str(),
        os("app"),
        os("oci:/tmp/x"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("registries only"), "{}", stderr(&out));
}

#[test]
fn a_user_without_privilege_pulls_lazily_and_reads_through_fuse() {
    require(not_root("it makes the unprivileged user's area"));
    require(cannot_fuse());
    let _dev = DevFuseMode::set(0o666);
    let area = Area::new();
    give_to_nobody(area.tmp.path());
    let registry = Registry::start(&area);
    let src = area.dir("src");
    tree(&src, 13, 10, 300 << 10);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&store, "app", &remote);

    let home = area.dir("home");
    give_to_nobody(&home);
    let mnt = area.dir("mnt");
    give_to_nobody(&mnt);
    let user = |args: &[&str]| {
        let mut c = Command::new(tilefs_bin());
        c.args(args)
            .env("HOME", &home)
            .env("XDG_DATA_HOME", home.join("data"))
            .env_remove("TILEFS_STORE")
            .env_remove("XDG_RUNTIME_DIR")
            .stdin(Stdio::null());
        as_nobody(&mut c).output().unwrap()
    };
    let out = user(&["pull", "-q", "--lazy", "--tls-verify=false", &remote]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), digest);
    let tag = format!("{}_team_app:v1", registry.addr);
    let out = user(&["mount", &tag, mnt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _m = Mounted(mnt.clone());
    // Read as the user: fetched into the user's store, by the user's server.
    let mut cat = Command::new("cat");
    cat.arg(mnt.join("d0/f000"));
    let out = as_nobody(&mut cat).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(out.stdout, fs::read(src.join("d0/f000")).unwrap());
    let user_store = home.join("data/tilefs/store");
    assert_eq!(objects_in(&user_store), 1);
    let d = fs::read_dir(&user_store)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().len() == 2)
        .unwrap();
    let obj = fs::read_dir(d.path()).unwrap().next().unwrap().unwrap();
    assert_eq!(
        fs::metadata(obj.path()).unwrap().uid(),
        NOBODY,
        "the object is the user's"
    );
    let out = user(&["umount", mnt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn push_takes_names_as_podman_does_and_waits_no_longer_than_the_timeout() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    tree(&src, 21, 5, 10 << 10);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    // A name with its registry needs no docker://.
    let v = push(&store, "app", &format!("{}/team/app:v1", registry.addr));
    assert_eq!(v["digest"], digest.as_str());
    assert_eq!(
        pull(
            &area.path("other"),
            &format!("docker://{}/team/app:v1", registry.addr),
            &[]
        ),
        digest
    );
    let push_fails = |dest: &str, extra: &[&str]| {
        let mut args = vec![
            os("push"),
            os("-q"),
            os("--tls-verify=false"),
            os("--store"),
            store.as_os_str(),
        ];
        args.extend(extra.iter().map(|s| os(s)));
        args.extend([os("app"), os(dest)]);
        let out = tilefs_any(&args);
        assert_eq!(out.status.code(), Some(1), "push to {dest}: {}", stderr(&out));
        stderr(&out)
    };
    // A short name names no registry: say where to write one.
    let err = push_fails("team/app:v1", &[]);
    assert!(err.contains("docker://HOST[:PORT]/team/app:v1"), "{err}");
    // Capitals.
    let err = push_fails(&format!("docker://{}/Team/app:v1", registry.addr), &[]);
    assert!(err.contains("repository names are lower case"), "{err}");
    // A registry that accepts and never answers: --timeout is the wait.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let t = Instant::now();
    let err = push_fails(&format!("docker://{addr}/team/app:v1"), &["--timeout", "3"]);
    assert!(t.elapsed() < Duration::from_secs(6), "took {:?}", t.elapsed());
    assert!(
        err.contains(&addr.to_string()) && err.contains("no answer within 3 s"),
        "{err}"
    );
    // On a terminal (script(1) gives it one), the progress display says
    // what it is doing (first: reading what the tag names now, whose packs
    // to keep), and that it is waiting for the server.
    let cmd = format!(
        "{} push --store {} --tls-verify=false --timeout 3 app docker://{addr}/team/app:v1",
        tilefs_bin().display(),
        store.display()
    );
    let out = on_terminal(&cmd);
    assert_eq!(out.status.code(), Some(1));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains(&format!("reading {addr}/team/app:v1, to keep its packs")),
        "{shown}"
    );
    assert!(shown.contains("(waiting for the server, 2 s)"), "{shown}");
    drop(silent);
}

#[test]
fn range_requests_that_drip_fail_at_the_least_rate() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    let files = tree(&src, 11, 4, 64 << 10);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&store, "app", &remote);
    // The packs come a byte a second.
    let m = skopeo_raw(&remote);
    let packs: Vec<String> = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["mediaType"].as_str().unwrap().contains(".pack."))
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect();
    assert!(!packs.is_empty());
    let relay = Relay::answering(&registry.addr, move |_, path| {
        match packs.iter().any(|p| path.ends_with(p.as_str())) {
            true => Answer::Drip {
                len: 1 << 20,
                per_second: 1,
            },
            false => Answer::Forward,
        }
    });
    let dripping = format!("docker://{}/team/app:v1", relay.addr);
    let t = Instant::now();
    let err = pull_fails(&area.path("s"), &dripping, &["--timeout", "2"]);
    assert!(
        err.contains("blob sha256:") && err.contains("less than 1024 bytes/s (--min-rate)"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
    // A lazy mount's fetches too (the default --min-rate, the timeout the
    // pull recorded): the read fails with EIO, the log says why.
    require(cannot_fuse());
    let lazy = area.path("lazy");
    assert_eq!(pull(&lazy, &dripping, &["--lazy", "--timeout", "2"]), digest);
    let tag = format!("{}_team_app:v1", relay.addr);
    let mnt = area.dir("mnt");
    let log = area.path("fuse.log");
    let (_m, _) = mount_tag(&lazy, &tag, &mnt, &log);
    let t = Instant::now();
    let e = read(&mnt.join(&files[0].0)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "a dripping read took {:?}",
        t.elapsed()
    );
    let logged = fs::read_to_string(&log).unwrap();
    assert!(logged.contains("--min-rate"), "{logged}");
}

/// Files of text (words drawn by `seed`: zstd makes them several times
/// smaller), `n` of `size` bytes in a few directories.
fn text_tree(root: &Path, seed: u64, n: usize, size: usize) -> Vec<String> {
    const WORDS: [&str; 16] = [
        "layer ",
        "image ",
        "object ",
        "pack ",
        "frame ",
        "registry ",
        "mount ",
        "store ",
        "digest ",
        "tree ",
        "file ",
        "verity ",
        "zstd ",
        "range ",
        "lazy ",
        "push\n",
    ];
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            let name = format!("t{}/f{i:04}", i % 7);
            let mut text = format!("{name} {}\n", rng.next_u64()).into_bytes();
            while text.len() < size {
                text.extend_from_slice(WORDS[rng.below(16) as usize].as_bytes());
            }
            text.truncate(size);
            let p = root.join(&name);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
            name
        })
        .collect()
}

/// Compressed packs: the artifact is a fraction of the files, pulls whole
/// and lazily to the same files (a lazy read fetching about the file's
/// frame), a new version with one file more uploads only the packs that
/// changed, and a damaged frame fails its file's read only.
#[test]
fn compressed_packs_pull_and_mount_and_a_new_version_sends_only_new_packs() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    let names = text_tree(&src, 11, 400, 128 << 10);
    let store = area.path("store");
    let digest = build_tag(&store, "v1", &src);
    let remote = |t: &str| format!("docker://{}/team/text:{t}", registry.addr);
    let first = push(&store, "v1", &remote("v1"));
    let m = skopeo_raw(&remote("v1"));
    let layers = m["layers"].as_array().unwrap();
    let blob_bytes: u64 = layers.iter().map(|l| l["size"].as_u64().unwrap()).sum();
    let object_bytes = first["object_bytes"].as_u64().unwrap();
    let n_packs = layers_of(&m, "pack").len();
    eprintln!("{n_packs} packs, {blob_bytes} bytes of blobs for {object_bytes} bytes of files");
    assert!(blob_bytes * 3 < object_bytes, "{blob_bytes} of {object_bytes}");
    assert!((2..=3).contains(&n_packs), "{n_packs} packs");

    // Whole: the same image, every object checked by fsck.
    let whole = area.path("whole");
    assert_eq!(pull(&whole, &remote("v1"), &[]), digest);
    assert!(fsck_text(&whole).contains("clean"));

    // A new version, one file of 31 KB more: only the pack that holds it
    // (and its neighbour, now and then) is new; pulled into the store
    // holding the first, it costs about that pack.
    text_tree(&area.dir("more"), 12, 1, 31 << 10);
    fs::copy(area.path("more").join("t0/f0000"), src.join("t3/added")).unwrap();
    let v2 = build_tag(&store, "v2", &src);
    let n = registry.requests().len();
    let second = push(&store, "v2", &remote("v2"));
    let sent = registry.uploaded_since(n);
    let m2 = skopeo_raw(&remote("v2"));
    let packs = |m: &serde_json::Value| -> Vec<String> { layers_of(m, "pack").into_iter().map(|p| p.0).collect() };
    let new_packs: Vec<String> = packs(&m2).into_iter().filter(|p| !packs(&m).contains(p)).collect();
    eprintln!("second push: {second}\nuploaded {sent:?}, new packs {new_packs:?}");
    assert!((1..=2).contains(&new_packs.len()), "{new_packs:?}");
    assert!(new_packs.iter().all(|p| sent.contains(p)));
    // The image's tree (one chunk, of 400 files), the configuration and
    // the new packs: no more.
    assert_eq!(sent.len(), 2 + new_packs.len(), "{sent:?}");
    let n = registry.requests().len();
    assert_eq!(pull(&whole, &remote("v2"), &[]), v2);
    let pulled = blob_bytes_since(&registry, n);
    assert!(pulled < blob_bytes / 2, "pulling v2 beside v1 read {pulled} bytes");

    // Pushed over the first version's tag, it keeps every pack of that
    // one: the new file alone makes a new pack. Pulled, it is the image.
    let n = registry.requests().len();
    let over = push(&store, "v2", &remote("v1"));
    let sent = registry.uploaded_since(n);
    eprintln!("over v1: {over}");
    assert_eq!(over["base"], "v1");
    assert_eq!(over["packs_kept"], packs(&m).len());
    let kept_and_new = packs(&skopeo_raw(&remote("v1")));
    assert_eq!(kept_and_new[..kept_and_new.len() - 1], packs(&m)[..]);
    assert_eq!(kept_and_new.len(), packs(&m).len() + 1);
    assert!(sent.contains(kept_and_new.last().unwrap()));
    // (The tree chunk and the configuration are v2's, there already.)
    assert!(sent.len() <= 3, "tree chunk, configuration, one pack: {sent:?}");
    assert!(over["bytes_uploaded"].as_u64().unwrap() < 100 << 10, "{over}");
    assert_eq!(pull(&area.path("over"), &remote("v1"), &[]), v2);
    assert!(fsck_text(&area.path("over")).contains("clean"));
    let out = tilefs_any(&[
        os("push"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
        os("--base"),
        os("nosuch"),
        os("v2"),
        os(&remote("v3")),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no such tag"), "{}", stderr(&out));

    // Lazily: a file's first read fetches about its frame, smaller than
    // the file; every file reads right.
    require(cannot_fuse());
    let lazy = area.path("lazy");
    assert_eq!(pull(&lazy, &remote("v2"), &["--lazy"]), v2);
    let mnt = area.dir("mnt");
    let log = area.path("fuse.log");
    let tag = format!("{}_team_text:v2", registry.addr);
    {
        let (_m, _) = mount_tag(&lazy, &tag, &mnt, &log);
        let n = registry.requests().len();
        assert_eq!(
            read(&mnt.join(&names[200])).unwrap(),
            fs::read(src.join(&names[200])).unwrap()
        );
        let one = blob_bytes_since(&registry, n);
        assert!(one > 0 && one < 128 << 10, "one file of 128 KiB fetched {one} bytes");
        assert_same_contents(&src, &mnt, &scan(&src));
    }

    // A byte of a pack changed where the registry keeps it: that file's
    // read fails (EIO, the log naming its object), the others read.
    let pack = registry.tamper_largest_blob();
    let err = pull_fails(&area.path("damaged"), &remote("v2"), &[]);
    assert!(err.contains(&pack) && err.contains("object "), "{err}");
    let fresh = area.path("fresh");
    pull(&fresh, &remote("v2"), &["--lazy"]);
    let (_m, _) = mount_tag(&fresh, &tag, &mnt, &log);
    let mut failed = Vec::new();
    for name in names.iter().chain([&"t3/added".to_string()]) {
        match read(&mnt.join(name)) {
            Ok(got) => assert_eq!(got, fs::read(src.join(name)).unwrap(), "{name}"),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{name}: {e}");
                failed.push(name.clone());
            }
        }
    }
    assert_eq!(failed.len(), 1, "exactly the damaged file fails: {failed:?}");
    let logged = fs::read_to_string(&log).unwrap();
    eprintln!("{logged}");
    assert!(logged.contains(&failed[0]) && logged.contains("object "), "{logged}");
}

/// `tilefs convert` makes, registry to registry, the artifact `tilefs pull`
/// then `push --runnable-from` make (the same manifest), leaving nothing
/// in its scratch directory.
#[test]
fn convert_gives_what_pull_and_push_runnable_give() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let fill = |root: &Path| {
        text_tree(root, 21, 30, 40 << 10);
        tree(root, 22, 10, 20 << 10);
    };
    let plain = push_image_with(&area, &registry, "plain", &[&fill], &["--config.cmd=/bin/true"]);
    let source = format!("docker://{plain}");
    let dest = |t: &str| format!("docker://{}/team/conv:{t}", registry.addr);

    let tmp = area.dir("tmp");
    let out = tilefs(&[
        os("convert"),
        os("--json"),
        os("--tls-verify=false"),
        os("--tmpdir"),
        tmp.as_os_str(),
        os(&source),
        os(&dest("converted")),
    ]);
    let converted: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(fs::read_dir(&tmp).unwrap().count(), 0, "the scratch store is removed");
    assert!(converted["source_bytes"].as_u64().unwrap() > 0, "{converted}");

    let store = area.path("store");
    pull(&store, &source, &["--tag", "plain"]);
    let out = tilefs(&[
        os("push"),
        os("--json"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
        os("--runnable-from"),
        os(&source),
        os("plain"),
        os(&dest("pushed")),
    ]);
    let pushed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(converted["digest"], pushed["digest"]);
    assert_eq!(converted["manifest_digest"], pushed["manifest_digest"]);
    assert_eq!(pushed["blobs_present"], pushed["blobs"], "{pushed}");

    // Converting an artifact, or into what is not a registry: refused.
    let out = tilefs_any(&[
        os("convert"),
        os("--tls-verify=false"),
        os(&dest("pushed")),
        os(&dest("again")),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("tilefs artifact"), "{}", stderr(&out));
    let out = tilefs_any(&[os("convert"), os("--tls-verify=false"), os(&source), os("oci:/nowhere")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("registries only"), "{}", stderr(&out));
    assert!(tilefs(&[os("convert"), os("--help")]).status.success());
}

/// The layers of an artifact's manifest whose media type has `kind`
/// ("tree", "pack"): digest and size.
fn layers_of(m: &serde_json::Value, kind: &str) -> Vec<(String, u64)> {
    m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["mediaType"].as_str().unwrap().contains(kind))
        .map(|l| (l["digest"].as_str().unwrap().to_string(), l["size"].as_u64().unwrap()))
        .collect()
}

/// Artifact format 3, the image's tree in chunks: a new version of a tree
/// of 7,000 files with one file of 31 KB more, pushed over the first,
/// uploads its configuration, the chunk or two around the new file and
/// the pack of its object, not the image; a pull rebuilds the image byte
/// for byte. A chunk of another tree (in a manifest that agrees with it)
/// is refused, naming the artifact; a chunk damaged in the registry fails
/// the pull naming the chunk. Format 2 (`--artifact-format 2`, the image
/// whole) is still written on request and pulled, whole and lazily.
#[test]
fn a_new_version_uploads_only_the_tree_chunks_around_its_change() {
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    let files: Vec<(String, usize)> = (0..7_000)
        .map(|i| (format!("d{:02}/file-{i:05}", i % 40), 100 + i % 200))
        .collect();
    write_files(&src, 21, &files);
    let store = area.path("store");
    build_tag(&store, "v1", &src);
    let remote = |t: &str| format!("docker://{}/team/tree:{t}", registry.addr);
    let first = push(&store, "v1", &remote("v1"));
    assert_eq!(first["format"], 3, "{first}");
    let m = skopeo_raw(&remote("v1"));
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers[0]["mediaType"], "application/vnd.tilefs.image.tree.v3");
    assert_eq!(layers[0]["annotations"]["org.tilefs.fsverity"], first["digest"]);
    let chunks = layers_of(&m, "tree");
    let packs = layers_of(&m, "pack");
    assert_eq!(chunks.len() + packs.len(), layers.len());
    let chunk_bytes: u64 = chunks.iter().map(|c| c.1).sum();
    eprintln!("{} chunks ({chunk_bytes} bytes), {} packs", chunks.len(), packs.len());
    assert!(chunks.len() >= 3, "{chunks:?}");

    // One file of 31 KB more, pushed over the first version.
    write_files(&src, 22, &[("d07/added-31k".into(), 31 << 10)]);
    let v2 = build_tag(&store, "v2", &src);
    let n = registry.requests().len();
    let second = push(&store, "v2", &remote("v1"));
    let sent = registry.uploaded_since(n);
    let m2 = skopeo_raw(&remote("v1"));
    let new_chunks: Vec<String> = layers_of(&m2, "tree")
        .into_iter()
        .filter(|c| !chunks.contains(c))
        .map(|c| c.0)
        .collect();
    eprintln!("second push: {second}\nuploaded {sent:?}, new chunks {new_chunks:?}");
    assert!((1..=2).contains(&new_chunks.len()), "{new_chunks:?}");
    assert!(new_chunks.iter().all(|c| sent.contains(c)));
    // The configuration, the new chunks and the new file's pack: no more.
    assert_eq!(sent.len(), new_chunks.len() + 2, "{sent:?}");
    let uploaded = second["bytes_uploaded"].as_u64().unwrap();
    assert!(
        uploaded * 2 < chunk_bytes,
        "{uploaded} bytes uploaded, the tree is {chunk_bytes}"
    );
    let whole = area.path("whole");
    assert_eq!(pull(&whole, &remote("v1"), &[]), v2);
    let tag = format!("{}_team_tree:v1", registry.addr);
    assert_eq!(
        fs::read(whole.join("images").join(&tag)).unwrap(),
        fs::read(store.join("images/v2")).unwrap()
    );
    assert!(fsck_text(&whole).contains("clean"));

    // Format 2 on request: the image whole, pulled as before.
    let out = tilefs(&[
        os("push"),
        os("--json"),
        os("--artifact-format"),
        os("2"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
        os("v2"),
        os(&remote("two")),
    ]);
    let two: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(two["format"], 2, "{two}");
    let m_two = skopeo_raw(&remote("two"));
    assert_eq!(m_two["layers"][0]["mediaType"], "application/vnd.tilefs.image.erofs.v2");
    assert_eq!(pull(&area.path("two"), &remote("two"), &["--lazy"]), v2);

    // A chunk of another tree, in a manifest made to agree with it: the
    // image it rebuilds is not the one the artifact records.
    let (victim, _) = layers_of(&m2, "tree")[1].clone();
    let mut chunk =
        tilefs_oci::artifact_tree::decode(&fs::read(registry.blob_file(&victim)).unwrap(), &victim).unwrap();
    chunk.dump = chunk.dump.replacen(" 100644 ", " 100600 ", 1);
    let lying = tilefs_oci::artifact_tree::encode_chunk(&chunk);
    let lying_digest = upload_blob(&registry, "team/tree", &lying);
    let mut liar = m2.clone();
    for l in liar["layers"].as_array_mut().unwrap() {
        if l["digest"] == victim.as_str() {
            l["digest"] = lying_digest.clone().into();
            l["size"] = lying.len().into();
        }
    }
    put_manifest(&registry, "team/tree", "liar", &serde_json::to_vec(&liar).unwrap());
    for extra in [&[][..], &["--lazy"]] {
        let s = area.path(&format!("liar{}", extra.len()));
        let err = pull_fails(&s, &remote("liar"), extra);
        assert!(
            err.contains("team/tree:liar") && err.contains("rebuilt") && err.contains("refused"),
            "{err}"
        );
        assert!(tags_in(&s).is_empty());
    }

    // A chunk's bytes changed where the registry keeps them: the pull
    // names that chunk and tags nothing.
    let data = registry.blob_file(&new_chunks[0]);
    let mut bytes = fs::read(&data).unwrap();
    bytes[10] ^= 0xff;
    fs::write(&data, &bytes).unwrap();
    for extra in [&[][..], &["--lazy"]] {
        let s = area.path(&format!("damaged{}", extra.len()));
        let err = pull_fails(&s, &remote("v1"), extra);
        assert!(
            err.contains(&new_chunks[0]) && err.contains("does not match its digest"),
            "{err}"
        );
        assert!(tags_in(&s).is_empty());
    }
}
