//! containers-registries.d YAML: any bytes give a configuration or an
//! error, never a panic; one that parses says where signatures of a few
//! images are, and builds their lookaside URLs, without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_trust::registries_d::{lookaside_url, RegistriesD};
use tilefs_trust::DockerRef;

fuzz_target!(|data: &[u8]| {
    let mut d = RegistriesD::default();
    if d.add(data, "fuzz.yaml").is_err() {
        return;
    }
    for r in [
        "docker.io/library/busybox:latest",
        "quay.io/a/b/c:d",
        "localhost:5000/x:y",
    ] {
        let r = DockerRef::parse_normalized(r).unwrap();
        let s = d.storage_for(&r);
        for base in s.lookaside.iter().chain(s.staging.iter()) {
            let _ = lookaside_url(
                base,
                &r.path,
                "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                1,
            );
        }
    }
});
