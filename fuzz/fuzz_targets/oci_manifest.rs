//! Manifest and index parsing, and reference parsing: any bytes give a
//! document or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_oci::manifest::{self, Document, Platform};

fuzz_target!(|data: &[u8]| {
    match manifest::parse(data, "fuzz") {
        Ok(Document::Index(i)) => {
            let _ = manifest::pick(&i, &Platform::host(), "fuzz");
        }
        Ok(Document::Manifest(m)) => {
            let _ = manifest::layers(&m, "fuzz", false);
            let _ = manifest::layers(&m, "fuzz", true);
            let _ = manifest::config(&m, "fuzz");
        }
        Err(_) => {}
    }
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(r) = tilefs_oci::ImageRef::parse(s) {
            tilefs_store::tags::validate_tag(&r.default_tag()).unwrap();
        }
    }
});
