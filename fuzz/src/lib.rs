//! The checks the fuzz targets run. They live with the tests of
//! `tilefs-image` so that `cargo test` replays the saved crash inputs
//! through exactly the same code (see `tests/fuzz_regressions.rs` there).

#[path = "../../crates/tilefs-image/tests/fuzz_checks/mod.rs"]
mod checks;

pub use checks::{parse_dump, read_image, roundtrip_image};
