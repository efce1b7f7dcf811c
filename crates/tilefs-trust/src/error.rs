//! [`Error`]: a file, key, signature or name that cannot be used (an image
//! that may not come in is [`crate::Refused`]). A caller matches on the
//! kind; the text is one line naming the file and the reason.

use crate::dockerref::RefError;
use std::path::PathBuf;

/// A file, key, signature or name that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A file that cannot be read, or (for a root service) trusted.
    #[error("{}: {reason}", path.display())]
    Read { path: PathBuf, reason: String },
    /// A configuration file, or a part of one, that says something invalid:
    /// `origin` names the file and the member.
    #[error("{origin}: {reason}")]
    Invalid { origin: String, reason: String },
    /// No signature policy exists where one is looked for.
    #[error(
        "no signature policy: {} does not exist{} (podman and skopeo refuse to pull without one too); \
         write one ({{\"default\": [{{\"type\": \"insecureAcceptAnything\"}}]}} accepts any image) \
         or pass --signature-policy FILE",
        path.display(),
        user.as_ref().map(|u| format!(" and neither does {}", u.display())).unwrap_or_default()
    )]
    NoPolicy { path: PathBuf, user: Option<PathBuf> },
    /// A name that is not a docker reference.
    #[error(transparent)]
    Reference(#[from] RefError),
    /// A short name registries.conf cannot turn into registry images.
    #[error("{0}")]
    ShortName(String),
    /// A key that is not one tilefs can use.
    #[error("{0}")]
    Key(String),
    /// A signature that does not check out (OpenPGP or sigstore).
    #[error("{0}")]
    Signature(String),
    /// A signed payload that is not a container signature.
    #[error("{0}")]
    Payload(String),
    /// Signing or making a key failed (gpg, randomness).
    #[error("{0}")]
    Sign(String),
}

impl Error {
    pub(crate) fn read(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Error {
        Error::Read {
            path: path.into(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn invalid(origin: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::Invalid {
            origin: origin.into(),
            reason: reason.into(),
        }
    }

    /// The same error of a part of the file `file` (`FILE: PART: why`).
    pub(crate) fn within(self, file: &str) -> Error {
        match self {
            Error::Invalid { origin, reason } => Error::invalid(format!("{file}: {origin}"), reason),
            e => Error::invalid(file, e.to_string()),
        }
    }
}
