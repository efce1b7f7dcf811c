//! containers-registries.conf (v1 and v2), as a file and as a drop-in over
//! it: any bytes give a configuration or an error, never a panic; one that
//! parses resolves short names and routes references without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use tilefs_trust::{DockerRef, RegistriesConf};

fuzz_target!(|data: &[u8]| {
    // The input split in two at the first NUL: the main file and a drop-in.
    let (main, dropin) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    };
    let mut c = RegistriesConf::default();
    if c.add(main, Path::new("registries.conf")).is_err() {
        return;
    }
    if let Some(d) = dropin {
        let _ = c.add(d, Path::new("registries.conf.d/50.conf"));
    }
    let _ = c.files_display();
    for name in [
        "busybox",
        "busybox:1",
        "team/app@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "quay.io/a/b:c",
        "localhost:5000/x",
        "Bad Name",
    ] {
        if let Ok(res) = c.resolve(name) {
            for cand in &res.candidates {
                let _ = c.route(cand);
            }
        }
        if let Ok(r) = DockerRef::parse_normalized(name) {
            let _ = c.route(&r);
            let _ = c.registry_for(&r);
        }
    }
});
