//! How a mount checks objects against the digests its image holds: one
//! setting for every way of mounting (the kernel's overlayfs `verity=`, the
//! FUSE server's own checks).

use std::fmt;
use std::str::FromStr;

/// How objects are checked against the image's fs-verity digests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verity {
    /// Every file is checked: a file the image holds no digest for, or
    /// whose object cannot be checked, is refused (by the kernel mount at
    /// mount time, by the FUSE server when it is opened).
    Require,
    /// Checked wherever possible; otherwise served unchecked (the kernel
    /// mount says so when it mounts).
    #[default]
    Auto,
    /// Never checked.
    Off,
}

impl FromStr for Verity {
    type Err = String;
    fn from_str(s: &str) -> Result<Verity, String> {
        match s {
            "require" => Ok(Verity::Require),
            "auto" => Ok(Verity::Auto),
            "off" => Ok(Verity::Off),
            _ => Err(format!("verity mode {s:?}: expected require, auto or off")),
        }
    }
}

impl fmt::Display for Verity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verity::Require => "require",
            Verity::Auto => "auto",
            Verity::Off => "off",
        })
    }
}
