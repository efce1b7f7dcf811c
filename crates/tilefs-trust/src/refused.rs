//! [`Refused`]: an image that may not come in (the policy's [`Refusal`], a
//! blocked registry, a store's missing record). It is kept apart from
//! [`crate::Error`] because it holds the policy's refusals while the
//! policy itself reports `Error`s.

use crate::policy::Refusal;
use crate::Error;
use std::path::PathBuf;

/// Why an image may not come in.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Refused {
    /// The signature policy refused it.
    #[error(transparent)]
    Policy(#[from] Box<Refusal>),
    /// Judged again from a store's records: every record was refused.
    #[error("{}", .0.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("; "))]
    Records(Vec<Refusal>),
    /// Judged again from a store's records, but it has none (it did not
    /// come in through a checked pull).
    #[error(
        "the image {image} has no record of a signature policy check in {} (it was built, committed or \
         pulled by a tilefs without signature policies, or its record was removed): pull it again",
        store.display()
    )]
    NoRecord { image: String, store: PathBuf },
    /// registries.conf blocks its registry.
    #[error("{image}: registry {domain} is blocked (prefix {prefix:?} of {files})")]
    Blocked {
        image: String,
        domain: String,
        prefix: String,
        files: String,
    },
    /// A file, name or record needed to judge it cannot be used.
    #[error("{image}: {error}")]
    Unusable { image: String, error: Error },
    /// The index of an image, judged as that image, was refused.
    #[error("its index {digest}: {refused}")]
    Index { digest: String, refused: Box<Refused> },
}

impl From<Refusal> for Refused {
    fn from(r: Refusal) -> Refused {
        Refused::Policy(Box::new(r))
    }
}
