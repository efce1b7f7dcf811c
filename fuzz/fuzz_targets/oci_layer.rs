//! The layer reader and applier: any bytes as a layer give an image or an
//! error naming the layer, never a panic; an image made is one the writer
//! accepts. The bytes after the first tar archive's end (past its zero
//! blocks) are a second layer, applied over the first, so that whiteouts
//! have something below to remove; without them the layer is applied
//! twice, over itself, as a later layer would be.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tilefs_image::erofs::{write_image, WriteOptions};
use tilefs_oci::apply::Applier;
use tilefs_oci::layer::{read_entries, ReadOptions};
use tilefs_store::ingest::{Ingest, Method};
use tilefs_store::Store;

fn store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tilefs-fuzz-store-{}", std::process::id()));
        Store::create(&dir).unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    // As pulls make images: keeping only `security.capability`, and
    // keeping every xattr (so that all of them meet the limits).
    for keep_all_xattrs in [false, true] {
        apply(data, keep_all_xattrs);
    }
});

fn apply(data: &[u8], keep_all_xattrs: bool) {
    let ingest = Ingest::new(store(), Method::Copy).unwrap();
    let mut applier = Applier::new(keep_all_xattrs);
    let mut rest = data;
    for i in 0..2 {
        let mut layer = if i == 0 { data } else { rest };
        // Sparse files may expand to a megabyte of holes here (a pull
        // allows 64 GiB: hashing them would only make timeouts).
        let holes = std::sync::atomic::AtomicU64::new(1 << 20);
        let opts = ReadOptions {
            sparse_budget: Some(&holes),
            ..ReadOptions::default()
        };
        let read = read_entries(&mut layer, "fuzz", &ingest, opts);
        if i == 0 {
            rest = layer;
            while rest.len() >= 512 && rest[..512].iter().all(|&b| b == 0) {
                rest = &rest[512..];
            }
            if rest.is_empty() {
                rest = data;
            }
        }
        match read {
            Ok(entries) => {
                if let Err(e) = applier.apply_layer("fuzz", entries) {
                    assert!(e.to_string().starts_with("layer fuzz"), "{e}");
                    return;
                }
            }
            Err(e) => {
                assert!(e.to_string().starts_with("layer fuzz"), "{e}");
                return;
            }
        }
    }
    tilefs_oci::compat::normalize(applier.tree_mut());
    let tree = applier.finish();
    let _ = write_image(&tree, &WriteOptions { min_version: 1, max_version: 1 });
}
