//! containerd's hosts.toml: any bytes give the hosts of a registry (mirrors
//! then the server) or an error naming the file, never a panic; each host
//! that parses makes URLs without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use tilefs_oci::transport::hosts;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = Path::new("/etc/containerd/certs.d/r:5000/hosts.toml");
    match hosts::parse(text, file, "r:5000", "https") {
        Ok(list) => {
            let last = list.last().expect("the server is always there");
            assert!(last.upstream);
            for h in &list {
                let _ = h.url("app/blobs/sha256:00", "r:5000");
            }
        }
        Err(e) => assert!(e.starts_with(&file.display().to_string()), "{e}"),
    }
});
