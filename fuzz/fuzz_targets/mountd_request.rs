//! The mount service's request parser: any bytes give a request or an
//! error, never a panic; a request parsed is one that prints back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_mount::mountd::proto::Request;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = Request::parse(data) {
        let again = serde_json::to_vec(&req).unwrap();
        assert_eq!(Request::parse(&again).unwrap(), req);
    }
});
