//! What can go wrong, as types: the gRPC adapter ([`crate::grpc`]) maps
//! each to the code containerd's errdefs read, in one place.

use std::path::PathBuf;

/// A snapshotter operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("snapshot {0:?} does not exist")]
    NotFound(String),
    #[error("parent snapshot {0:?} does not exist")]
    ParentNotFound(String),
    #[error("snapshot {0:?} already exists")]
    AlreadyExists(String),
    /// CRI's Prepare of a layer served lazily: containerd's signal that
    /// the snapshot it will walk for is there.
    #[error("target snapshot {0:?} exists (served lazily)")]
    ServedLazily(String),
    /// An empty key (or name) in a request.
    #[error("a snapshot {0} must not be empty")]
    Empty(&'static str),
    #[error("parent snapshot {0:?} is not committed")]
    ParentNotCommitted(String),
    #[error("snapshot {0:?} is not active: only an active snapshot is committed")]
    NotActive(String),
    #[error("snapshot {0:?} is committed: it has no mounts (prepare or view one on it)")]
    NoMounts(String),
    #[error("snapshot {key:?} has a child ({child:?}): remove it first")]
    HasChild { key: String, child: String },
    #[error("cannot update field {field:?} of snapshot {key:?} (only labels can be)")]
    Immutable { key: String, field: String },
    #[error("{0}")]
    Filter(#[from] crate::filter::FilterError),
    /// A layer CRI asked to be served lazily that could not be (the
    /// registry, the store): containerd may ask again.
    #[error("{0}")]
    Lazy(String),
    /// The signature policy refuses an image CRI pulls.
    #[error("{0}")]
    Refused(String),
    /// A file or directory of the snapshotter's root or the store.
    #[error("{}: {what}: {err}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        err: std::io::Error,
    },
    #[error("{0}")]
    Store(#[from] tilefs_store::StoreError),
    /// A committed snapshot's upper directory read as a layer.
    #[error(transparent)]
    Layer(#[from] crate::layer::LayerError),
    #[error("{0}")]
    Oci(#[from] tilefs_oci::OciError),
    /// The snapshotter's own state is not as it must be (a record, a
    /// layer, a journal, a chain).
    #[error("{0}")]
    Broken(String),
    /// `error`, with what was being done.
    #[error("{what}: {error}")]
    Context { what: String, error: Box<Error> },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, what: &'static str, err: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            what,
            err,
        }
    }

    /// `self`, saying what was being done.
    pub(crate) fn context(self, what: impl Into<String>) -> Error {
        Error::Context {
            what: what.into(),
            error: Box::new(self),
        }
    }

    /// The error under the context given to it.
    pub fn root_cause(&self) -> &Error {
        match self {
            Error::Context { error, .. } => error.root_cause(),
            e => e,
        }
    }
}

/// `Result` of the snapshotter's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
