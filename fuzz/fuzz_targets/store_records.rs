//! What tilefs reads back from a store's bookkeeping, which anyone who can
//! write the store may have written: a holder's record
//! (`.owned/HOLDER/.owner`) and a mount record's header line (`.mounts/*`).
//! Each is parsed or refused, never a panic; what parses is written back
//! to the same meaning.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_store::mounts::{header_line, parse_header};
use tilefs_store::owned::Holder;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Holder::parse(data) {
        let again = serde_json::to_vec(&h).unwrap();
        assert_eq!(Holder::parse(&again).as_ref(), Ok(&h));
    }
    if let Ok(h) = parse_header(data) {
        let line = header_line(&h);
        let line = line.strip_suffix('\n').expect("a header line ends in a newline");
        assert_eq!(parse_header(line.as_bytes()).as_ref(), Ok(&h));
    }
});
