//! Ordinary OCI images (gzip layers made by umoci, pushed by skopeo to
//! Debian's docker-registry, which has no referrers API) started lazily
//! through `tilefs index`: the index is listed in the fallback tag beside
//! another referrer, `pull --lazy` gives the image a full pull gives, a
//! FUSE mount shows the same tree and fetches about a checkpoint's span
//! for a small file (a kernel mount of a lazy pull, filling placeholders,
//! shows it too), and a proxy that flips a byte of range answers fails
//! only the file they belong to. Without an index, `pull --lazy` pulls
//! whole and says so. A zstd image (skopeo's recompression) is indexed and
//! pulled lazily too. Against a registry that has the referrers API
//! (go-containerregistry's), the index is listed and found through it, with
//! no fallback tag.

mod common;

use common::oci::*;
use common::registry::{curl_put, Pass, ReferrersRegistry, Registry, Relay};
use common::*;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

fn get(r: &Registry, path: &str, accept: &str) -> Vec<u8> {
    let out = Command::new("curl")
        .args(["-sf", "-H"])
        .arg(format!("Accept: {accept}"))
        .arg(format!("http://{}{path}", r.addr))
        .output()
        .unwrap();
    assert!(out.status.success(), "GET {path}");
    out.stdout
}

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// Another tool's referrer of `subject` in `repo`, listed in the fallback
/// tag as such a tool lists it.
fn other_referrer(r: &Registry, repo: &str, subject: &str, subject_size: usize) -> String {
    let (cd, cs) = r.upload_blob(repo, b"{}");
    let (ld, ls) = r.upload_blob(repo, b"a signature, say");
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": "application/x.other",
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": cd, "size": cs},
        "layers": [{"mediaType": "application/x.other.blob", "digest": ld, "size": ls}],
        "subject": {"mediaType": OCI_MANIFEST, "digest": subject, "size": subject_size},
    }))
    .unwrap();
    let md = format!("sha256:{}", sha256_hex(&manifest));
    let base = format!("http://{}/v2/{repo}/manifests", r.addr);
    curl_put(&format!("{base}/{md}"), OCI_MANIFEST, &manifest, "PUT");
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [{"mediaType": OCI_MANIFEST, "digest": md, "size": manifest.len(),
            "artifactType": "application/x.other"}],
    }))
    .unwrap();
    let tag = subject.replace(':', "-");
    curl_put(&format!("{base}/{tag}"), OCI_INDEX, &index, "PUT");
    md
}

/// What a user sees of every path under `root`, but the inode numbers
/// (which the kernel's mount and FUSE number each their own way).
fn view(root: &Path) -> Vec<(Vec<u8>, Seen)> {
    scan(root)
        .into_iter()
        .map(|(p, mut s)| {
            s.ino = 0;
            (p, s)
        })
        .collect()
}

#[test]
fn an_indexed_ordinary_image_mounts_lazily_and_checks_every_byte() {
    require(cannot_fuse());
    require(missing_program("umoci", "umoci"));
    require(missing_program("skopeo", "skopeo"));
    let area = Area::new();
    let registry = Registry::start(&area);
    // Two gzip layers: many 1 MiB files (checkpoints every 4 MiB or so of
    // the tar stream), then a layer that removes one, replaces another,
    // and adds a file of 6 MiB alone.
    let base = |root: &Path| {
        tree(root, 11, 32, 1 << 20);
        write_files(root, 12, &[("etc/config".into(), 3000)]);
    };
    let top = |root: &Path| {
        fs::remove_file(root.join("d1/f001")).unwrap();
        write_files(root, 13, &[("d2/f002".into(), 5000), ("big/lone".into(), 6 << 20)]);
    };
    let remote = push_image_with(&area, &registry, "app", &[&base, &top], &[]);
    let docker = format!("docker://{remote}");
    let repo = "tilefs/app";
    let manifest = get(&registry, &format!("/v2/{repo}/manifests/v1"), OCI_MANIFEST);
    let subject = format!("sha256:{}", sha256_hex(&manifest));
    let m: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
    let layer_bytes: u64 = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap())
        .sum();

    // No index yet: `--lazy` pulls whole, and says why.
    let full = area.path("full");
    let out = run_pull(&full, &docker, &["--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = tilefs_any(&[
        os("pull"),
        os("--json"),
        os("--lazy"),
        os("--tls-verify=false"),
        os("--store"),
        full.as_os_str(),
        os(&docker),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let why = report["lazy_fallback"].as_str().unwrap_or_default();
    assert!(
        why.contains("has no tilefs index") && why.contains("tilefs index"),
        "{report}"
    );
    assert!(stderr(&out).contains("pulled whole, not lazily"), "{}", stderr(&out));
    assert_eq!(report["lazy_objects"], 0);
    let digest = report["digest"].as_str().unwrap().to_string();

    // Another tool's referrer is listed already; the index joins it.
    let other = other_referrer(&registry, repo, &subject, manifest.len());
    let out = tilefs(&[
        os("index"),
        os("--json"),
        os("--tls-verify=false"),
        os("--store"),
        area.path("indexing").as_os_str(),
        os(&docker),
    ]);
    let ix: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("{ix}");
    assert_eq!(ix["digest"], digest.as_str(), "the index's image is the one pull makes");
    assert_eq!(ix["subject"], subject.as_str());
    assert_eq!(ix["referrers_api"], false);
    let tag = subject.replace(':', "-");
    assert_eq!(ix["fallback_tag"], tag.as_str());
    let index_bytes = ix["index_bytes"].as_u64().unwrap();
    assert!(
        index_bytes * 20 <= layer_bytes,
        "index {index_bytes} for {layer_bytes} of layers"
    );
    let listed: serde_json::Value =
        serde_json::from_slice(&get(&registry, &format!("/v2/{repo}/manifests/{tag}"), OCI_INDEX)).unwrap();
    let digests: Vec<&str> = listed["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["digest"].as_str().unwrap())
        .collect();
    assert_eq!(digests, [other.as_str(), ix["manifest_digest"].as_str().unwrap()]);

    // A lazy pull fetches the index, not the layers, and makes the image
    // a full pull makes.
    let lazy = area.path("lazy");
    let n = registry.requests().len();
    let out = tilefs(&[
        os("pull"),
        os("--json"),
        os("--lazy"),
        os("--tls-verify=false"),
        os("--store"),
        lazy.as_os_str(),
        os(&docker),
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["digest"], digest.as_str());
    assert_eq!(report["lazy_index"], ix["manifest_digest"]);
    assert!(report["lazy_objects"].as_u64().unwrap() > 30, "{report}");
    let sent = blob_bytes_since(&registry, n);
    assert!(
        sent <= index_bytes,
        "a lazy pull sent {sent} bytes (index {index_bytes})"
    );
    assert_eq!(objects_in(&lazy), 0);

    // Mounted: a small file costs about a checkpoint's span of the layer,
    // and the whole tree reads as a full pull's mount shows it.
    let img = format!("{}_tilefs_app:v1", registry.addr);
    let (mnt_full, mnt_lazy) = (area.dir("mnt-full"), area.dir("mnt-lazy"));
    let (_full, _) = mount_tag(&full, &img, &mnt_full, &area.path("full.log"));
    let (_lazy, _) = mount_tag(&lazy, &img, &mnt_lazy, &area.path("lazy.log"));
    let n = registry.requests().len();
    let small = read(&mnt_lazy.join("d3/f008")).unwrap();
    let sent = blob_bytes_since(&registry, n);
    eprintln!("reading a 1 MiB file fetched {sent} of {layer_bytes} bytes of layers");
    assert!(
        sent * 4 < layer_bytes,
        "reading one file fetched {sent} of {layer_bytes}"
    );
    assert_eq!(small, read(&mnt_full.join("d3/f008")).unwrap());
    assert_eq!(view(&mnt_lazy), view(&mnt_full));
    let files = assert_same_contents(&mnt_full, &mnt_lazy, &scan(&mnt_full));
    assert!(files > 30, "{files}");
    drop(_lazy);

    // Pulled lazily again and mounted by the kernel (tests/kernel_lazy.rs):
    // placeholders filled from the layers' ranges as they are read, the
    // same tree.
    if is_root() && cannot_mount("erofs").is_none() {
        let lazy_k = area.path("lazy-kernel");
        pull(&lazy_k, &docker, &["--lazy"]);
        let mnt_k = area.dir("mnt-kernel");
        let log = area.path("kernel.log");
        tilefs(&[
            os("mount"),
            os("--store"),
            lazy_k.as_os_str(),
            os("--log"),
            log.as_os_str(),
            os(&img),
            mnt_k.as_os_str(),
        ]);
        let _k = Mounted(mnt_k.clone());
        assert!(mount_line(&mnt_k).unwrap().contains(" - overlay "), "a kernel mount");
        assert_eq!(view(&mnt_k), view(&mnt_full));
        assert_same_contents(&mnt_full, &mnt_k, &scan(&mnt_full));
    }

    // A proxy that flips the byte 64 KiB into each range answer's body
    // while armed (well inside the big file, whatever checkpoint its
    // ranges start at): that file's read fails with EIO and nothing wrong
    // is kept (read again unarmed, it is right); other files read right.
    let armed = Arc::new(AtomicBool::new(false));
    let flipping = armed.clone();
    let until_flip = Mutex::new(None::<usize>);
    let relay = Relay::start(&registry.addr, move |chunk, _| {
        let mut left = until_flip.lock().unwrap();
        let mut body = 0;
        // An answer's head comes at the start of a read: the client waits
        // for each answer before it asks again.
        if chunk.starts_with(b"HTTP/1.1 ") {
            *left = None;
            let head = chunk.windows(4).position(|w| w == b"\r\n\r\n");
            if let Some(h) = head.filter(|_| chunk.starts_with(b"HTTP/1.1 206") && flipping.load(Relaxed)) {
                (*left, body) = (Some(64 << 10), h + 4);
            }
        }
        if let Some(n) = *left {
            match body + n < chunk.len() {
                true => (chunk[body + n], *left) = (chunk[body + n] ^ 0x55, None),
                false => *left = Some(n - (chunk.len() - body)),
            }
        }
        Pass::All
    });
    let flipped = area.path("flipped");
    pull(&flipped, &format!("docker://{}/{repo}:v1", relay.addr), &["--lazy"]);
    let mnt = area.dir("mnt-flipped");
    let log = area.path("flipped.log");
    let img = format!("{}_tilefs_app:v1", relay.addr);
    let (_m, _) = mount_tag(&flipped, &img, &mnt, &log);
    armed.store(true, Relaxed);
    let err = read(&mnt.join("big/lone")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(5), "EIO expected: {err}");
    let text = fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("fetch from"), "{text}");
    armed.store(false, Relaxed);
    assert_eq!(
        read(&mnt.join("d0/f005")).unwrap(),
        read(&mnt_full.join("d0/f005")).unwrap()
    );
    assert_eq!(read(&mnt.join("etc/config")).unwrap(), Rng::new(12).bytes(3000));
    assert_eq!(
        read(&mnt.join("big/lone")).unwrap(),
        read(&mnt_full.join("big/lone")).unwrap()
    );
}

/// `tilefs index` of the image, with `flags`: its JSON report.
fn index_json(area: &Area, docker: &str, flags: &[&str]) -> serde_json::Value {
    let store = area.path("indexing");
    let mut args = vec![os("index"), os("--json"), os("--tls-verify=false"), os("--store")];
    args.push(store.as_os_str());
    args.extend(flags.iter().map(|f| os(f)));
    args.push(os(docker));
    serde_json::from_slice(&tilefs(&args).stdout).unwrap()
}

/// `pull --lazy` of `docker` into a new store `name`: its JSON report.
fn lazy_pull(area: &Area, name: &str, docker: &str) -> serde_json::Value {
    let store = area.path(name);
    let out = tilefs(&[
        os("pull"),
        os("--json"),
        os("--lazy"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
        os(docker),
    ]);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The index carries its image as tree chunks (format 2): the index of a
/// new version of the image (a layer more, with a 31 KB file) uploads its
/// configuration, the chunks around the change and the new layer's map,
/// no more; an index of format 1 (the image whole, `--index-format 1`)
/// still pulls, to the same image.
#[test]
fn a_new_version_reindexed_uploads_only_the_tree_chunks_around_its_change() {
    require(missing_program("umoci", "umoci"));
    require(missing_program("skopeo", "skopeo"));
    let area = Area::new();
    let registry = Registry::start(&area);
    let files: Vec<(String, usize)> = (0..5_000)
        .map(|i| (format!("d{:02}/file-{i:05}", i % 40), 100 + i % 200))
        .collect();
    let base = |root: &Path| write_files(root, 31, &files);
    let v1 = format!("docker://{}", push_image_with(&area, &registry, "app", &[&base], &[]));

    // Format 1 still pulls (the newest index is the one used).
    let old = index_json(&area, &v1, &["--index-format", "1"]);
    assert_eq!(
        (old["format"].as_u64(), old["image_blobs"].as_u64()),
        (Some(1), Some(1)),
        "{old}"
    );
    let pulled = lazy_pull(&area, "old", &v1);
    assert_eq!(pulled["lazy_index"], old["manifest_digest"], "{pulled}");
    assert_eq!(pulled["digest"], old["digest"]);

    let ix1 = index_json(&area, &v1, &[]);
    assert_eq!(ix1["format"], 2, "{ix1}");
    assert_eq!(ix1["digest"], old["digest"], "the same image, in chunks");
    let chunks = ix1["image_blobs"].as_u64().unwrap();
    assert!(chunks >= 2, "{ix1}");
    let pulled = lazy_pull(&area, "new", &v1);
    assert_eq!(pulled["lazy_index"], ix1["manifest_digest"], "{pulled}");
    assert_eq!(pulled["digest"], ix1["digest"]);
    assert!(pulled["lazy_objects"].as_u64().unwrap() > 100, "{pulled}");

    // The next version: one file of 31 KB more, in a layer of its own.
    let v2 = push_next_version(&area, &registry.addr, "app", "v2", &|root| {
        write_files(root, 32, &[("d07/added-31k".into(), 31 << 10)])
    });
    let v2 = format!("docker://{v2}");
    let n = registry.requests().len();
    let ix2 = index_json(&area, &v2, &[]);
    let sent = registry.uploaded_since(n);
    eprintln!("second index: {ix2}\nuploaded {sent:?}");
    assert_eq!(ix2["format"], 2, "{ix2}");
    // Its configuration, the new layer's map, and 1 or 2 chunks.
    assert!((3..=4).contains(&sent.len()), "{sent:?}");
    assert!(
        ix2["blobs_uploaded"].as_u64() == Some(sent.len() as u64),
        "{ix2} {sent:?}"
    );
    let pulled = lazy_pull(&area, "v2", &v2);
    assert_eq!(pulled["lazy_index"], ix2["manifest_digest"], "{pulled}");
    assert_eq!(pulled["digest"], ix2["digest"]);
}

#[test]
fn an_indexed_zstd_image_pulls_lazily_to_the_image_a_full_pull_makes() {
    require(cannot_fuse());
    require(missing_program("umoci", "umoci"));
    require(missing_program("skopeo", "skopeo"));
    let area = Area::new();
    let registry = Registry::start(&area);
    let fill = |root: &Path| write_files(root, 21, &[("etc/config".into(), 3000), ("data/blob".into(), 3 << 20)]);
    // skopeo recompresses umoci's gzip layer as zstd.
    let remote = push_image_as(
        &area,
        &registry,
        "zapp",
        &[&fill],
        &[],
        &["--dest-compress-format", "zstd"],
    );
    let docker = format!("docker://{remote}");
    let m: serde_json::Value =
        serde_json::from_slice(&get(&registry, "/v2/tilefs/zapp/manifests/v1", OCI_MANIFEST)).unwrap();
    assert_eq!(
        m["layers"][0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+zstd",
        "{m}"
    );

    let full = area.path("full");
    let out = run_pull(&full, &docker, &["--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let digest = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["digest"].clone();
    let out = tilefs(&[
        os("index"),
        os("--json"),
        os("--tls-verify=false"),
        os("--store"),
        area.path("indexing").as_os_str(),
        os(&docker),
    ]);
    let ix: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ix["digest"], digest);

    let lazy = area.path("lazy");
    let out = tilefs(&[
        os("pull"),
        os("--json"),
        os("--lazy"),
        os("--tls-verify=false"),
        os("--store"),
        lazy.as_os_str(),
        os(&docker),
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["digest"], digest, "{report}");
    assert_eq!(report["lazy_index"], ix["manifest_digest"]);
    assert_eq!(objects_in(&lazy), 0);
    let mnt = area.dir("mnt");
    let img = format!("{}_tilefs_zapp:v1", registry.addr);
    let (_m, _) = mount_tag(&lazy, &img, &mnt, &area.path("lazy.log"));
    // The files as written (one generator, in order), read from the
    // mount: the single-frame layer is fetched whole on first use.
    let mut want = Rng::new(21);
    assert_eq!(read(&mnt.join("etc/config")).unwrap(), want.bytes(3000));
    assert_eq!(read(&mnt.join("data/blob")).unwrap(), want.bytes(3 << 20));
}

#[test]
fn an_index_is_listed_and_found_through_the_referrers_api() {
    require(cannot_fuse());
    require(missing_program("umoci", "umoci"));
    require(missing_program("skopeo", "skopeo"));
    let area = Area::new();
    let Some(registry) = ReferrersRegistry::start(&area) else {
        return;
    };
    let data = |root: &Path| write_files(root, 21, &[("etc/msg".into(), 3000), ("big/lone".into(), 2 << 20)]);
    let remote = push_image_to(&area, &registry.addr, "app", &[&data], &[], &[]);
    let docker = format!("docker://{remote}");
    let indexing = area.path("indexing");
    let index = checked(
        Command::new(tilefs_bin())
            .args(["index", "--json", "--tls-verify=false", "--store"])
            .arg(&indexing)
            .arg(&docker),
    );
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    eprintln!("tilefs index against a registry with the referrers API: {index}");
    assert_eq!(index["referrers_api"], true, "{index}");
    assert_eq!(index["fallback_tag"], serde_json::Value::Null, "{index}");
    let subject = index["subject"].as_str().unwrap().to_string();
    let fallback = subject.replace(':', "-");

    let store = area.path("store");
    let out = run_pull(&store, &docker, &["--json", "--lazy", "--tag", "app"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["lazy_index"], index["manifest_digest"], "{report}");
    assert!(report["lazy_objects"].as_u64().unwrap() > 0, "{report}");
    // A lazy mount reads the file from the ordinary layer (one shorter
    // than a checkpoint's span: fetched whole on first use).
    let mnt = area.dir("mnt");
    let (m, _) = mount_tag(&store, "app", &mnt, &area.path("mount.log"));
    assert_eq!(
        read(&mnt.join("etc/msg")).unwrap(),
        read(&area.path("bundle-app/rootfs/etc/msg")).unwrap()
    );
    drop(m);

    let requests = registry.requests();
    let referrers: Vec<_> = requests
        .iter()
        .filter(|r| r.method == "GET" && r.path.starts_with(&format!("/v2/tilefs/app/referrers/{subject}")))
        .map(|r| r.status)
        .collect();
    let tagged: Vec<_> = requests.iter().filter(|r| r.path.contains(&fallback)).collect();
    eprintln!("referrers API GETs (index, pull): {referrers:?}; fallback tag requests: {tagged:?}");
    assert_eq!(referrers, [200, 200], "the referrers API was not asked by both");
    assert_eq!(tagged.len(), 0, "the fallback tag was used: {tagged:?}");
}

/// A file longer than a piece (8 MiB of the tar stream, each decoded from
/// its own checkpoint) is read in pieces that end at checkpoints, so the
/// compressed bytes of one piece's last span are not fetched again for
/// the next: reading it fetches no more than the layer blob holds.
#[test]
fn a_long_file_is_read_without_fetching_a_byte_twice() {
    require(cannot_fuse());
    require(missing_program("umoci", "umoci"));
    require(missing_program("skopeo", "skopeo"));
    let area = Area::new();
    let registry = Registry::start(&area);
    let data = |root: &Path| write_files(root, 31, &[("etc/msg".into(), 100), ("big/long".into(), 20 << 20)]);
    let remote = push_image_with(&area, &registry, "long", &[&data], &[]);
    let docker = format!("docker://{remote}");
    checked(
        Command::new(tilefs_bin())
            .args(["index", "-q", "--tls-verify=false", "--store"])
            .arg(area.path("indexing"))
            .arg(&docker),
    );
    let store = area.path("store");
    let out = run_pull(&store, &docker, &["--lazy", "--tag", "long"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let layer = skopeo_raw(&docker)["layers"][0].clone();
    let (blob, size) = (
        layer["digest"].as_str().unwrap().to_string(),
        layer["size"].as_u64().unwrap(),
    );
    let mnt = area.dir("mnt");
    let (_m, _) = mount_tag(&store, "long", &mnt, &area.path("mount.log"));
    let n = registry.requests().len();
    let read_back = read(&mnt.join("big/long")).unwrap();
    assert!(
        read_back == read(&area.path("bundle-long/rootfs/big/long")).unwrap(),
        "big/long reads wrong"
    );
    let gets: Vec<(u16, u64)> = registry.requests()[n..]
        .iter()
        .filter(|r| r.method == "GET" && r.path.ends_with(&blob))
        .map(|r| (r.status, r.bytes))
        .collect();
    let fetched: u64 = gets.iter().map(|g| g.1).sum();
    eprintln!("reading a 20 MiB file: GETs of its layer {gets:?}, {fetched} bytes of a {size}-byte blob");
    assert!(gets.iter().all(|g| g.0 == 206), "not range GETs: {gets:?}");
    assert!(fetched <= size, "{fetched} bytes fetched of a {size}-byte blob");
}
