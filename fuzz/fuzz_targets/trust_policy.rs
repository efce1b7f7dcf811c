//! containers-policy.json: any bytes give a policy or an error, never a
//! panic; a policy that parses decides about a few images (registry and
//! local, with no signatures) without a panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_trust::policy::{NoSignatures, Policy, Subject};
use tilefs_trust::DockerRef;

fuzz_target!(|data: &[u8]| {
    let Ok(p) = Policy::parse(data, "fuzz") else { return };
    for r in [
        "docker.io/library/busybox:latest",
        "quay.io/a/b/c@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "localhost:5000/x:y",
    ] {
        let r = DockerRef::parse_normalized(r).unwrap();
        let s = Subject::docker(&r);
        let _ = p.needs_signatures(&s);
        let _ = p.evaluate(&s, b"{}", &NoSignatures("fuzz"));
    }
    let s = Subject::path(
        "oci",
        std::path::Path::new("/nonexistent/layout"),
        Some("a"),
        "oci:/nonexistent/layout:a".into(),
    );
    let _ = p.evaluate(&s, b"{}", &NoSignatures("fuzz"));
});
