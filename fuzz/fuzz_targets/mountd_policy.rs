//! The mount service's policy parser: any text gives a policy or an
//! error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_mount::mountd::policy::Policy;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = Policy::parse(text);
    }
});
