//! The layer reader and applier: any bytes as a layer (applied twice, over
//! itself, as a later layer would) give an image or an error naming the
//! layer, never a panic; an image made is one the writer accepts.
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
    let ingest = Ingest::new(store(), Method::Copy).unwrap();
    let mut applier = Applier::new();
    for _ in 0..2 {
        match read_entries(&mut &data[..], "fuzz", &ingest, ReadOptions::default()) {
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
    tilefs_oci::compat::normalize(applier.tree_mut(), false);
    let tree = applier.finish();
    let _ = write_image(&tree, &WriteOptions { min_version: 1, max_version: 1 });
});
