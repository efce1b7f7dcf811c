//! tilefs-oci: OCI images in, tilefs images out.
//!
//! - [`reference`]: image references in skopeo's transport syntax;
//! - [`transport`]: where manifests and blobs come from (an OCI layout, an
//!   OCI or Docker archive, a registry through the distribution API), every
//!   blob checked against its digest as it streams;
//! - [`bounded`]: documents read with their size cap while they stream;
//! - [`manifest`]: from an index or manifest to the list of layers;
//! - [`layer`]: one layer's tar stream to entries, file contents into the
//!   store (layers are read in parallel);
//! - [`layer_cache`]: layers already read, not read again;
//! - [`apply`]: layers applied in order into one tree (whiteouts, opaque
//!   directories, replacements, hardlinks);
//! - [`compat`]: composefs-rs's rules, so both tools give the same image;
//! - [`pull`]: all of it, from a reference to an image in a store;
//! - [`artifact`]: tilefs images as OCI artifacts (images, object indexes,
//!   packs of objects);
//! - [`push`]: a tagged image and its objects to a registry;
//! - [`fetch`]: an artifact's objects by range, all the store lacks or
//!   each when first read (lazy pulls); `flights`: one fetch of an object
//!   at a time in a process, its answer shared by every reader waiting;
//! - [`lazy_index`]: indexes of ordinary images (`tilefs index`), so that
//!   they start lazily unconverted; [`referrers`]: how an index is listed
//!   beside its image (the referrers API, or the fallback tag);
//!   `layer_fetch`: objects read out of byte ranges of ordinary layers;
//! - [`toc_lazy`]: eStargz and zstd:chunked images pulled lazily as they
//!   are, from their layers' tables of contents;
//! - [`trust`]: the signature policy, registries.d and registries.conf on
//!   every path that brings an image in, and signing on push.

pub mod apply;
pub mod artifact;
pub mod artifact_tree;
pub mod bounded;
pub mod compat;
pub mod digest;
pub mod fetch;
mod flights;
pub mod layer;
pub mod layer_cache;
mod layer_fetch;
pub mod layer_store;
pub mod lazy_index;
pub mod manifest;
pub mod pull;
pub mod push;
pub mod reference;
pub mod referrers;
pub mod toc_lazy;
pub mod transport;
pub mod trust;

pub use pull::{pull, PullOptions, PullReport};
pub use reference::ImageRef;

/// What a pull or push is doing now, for a progress display: a phrase
/// ("resolving docker://…", "layer 2 of 5") and whether it waits on the
/// network (a display says so when no bytes come for a while).
#[derive(Debug, Default)]
pub struct Stage(std::sync::Mutex<(String, bool)>);

impl Stage {
    pub fn set(&self, text: impl Into<String>, network: bool) {
        *self.0.lock().unwrap() = (text.into(), network);
    }

    /// The phrase, and whether it waits on the network.
    pub fn get(&self) -> (String, bool) {
        self.0.lock().unwrap().clone()
    }
}

use tilefs_store::StoreError;

/// Why a pull failed. Every message names the blob, entry, file or
/// registry at fault and the reason.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("{0}")]
    Reference(String),
    /// A layer that cannot be read or applied.
    #[error("layer {blob}{}: {reason}", entry.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    Layer {
        blob: String,
        entry: Option<String>,
        reason: String,
    },
    /// A blob that is not what its descriptor says.
    #[error("blob {blob}: {reason}")]
    Blob { blob: String, reason: String },
    /// An index, manifest or configuration that is not one.
    #[error("{what}: {reason}")]
    Manifest { what: String, reason: String },
    /// A registry that refused, failed or did not answer.
    #[error("registry {registry}: {reason}")]
    Registry { registry: String, reason: String },
    #[error("{}: {what}: {err}", path.display())]
    Io {
        path: std::path::PathBuf,
        what: &'static str,
        err: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("interrupted")]
    Interrupted,
    /// The signature policy or registries.conf refused the image: which
    /// image, which scope or table, and why.
    #[error(transparent)]
    Refused(#[from] tilefs_trust::Refused),
    /// A trust configuration file, key or name that cannot be used.
    #[error(transparent)]
    Trust(#[from] tilefs_trust::Error),
}

impl OciError {
    pub fn layer(blob: &str, entry: Option<&str>, reason: impl Into<String>) -> OciError {
        OciError::Layer {
            blob: blob.to_string(),
            entry: entry.map(str::to_string),
            reason: reason.into(),
        }
    }

    pub fn blob(blob: &str, reason: impl Into<String>) -> OciError {
        OciError::Blob {
            blob: blob.to_string(),
            reason: reason.into(),
        }
    }

    pub fn manifest(what: impl Into<String>, reason: impl Into<String>) -> OciError {
        OciError::Manifest {
            what: what.into(),
            reason: reason.into(),
        }
    }

    pub fn io(path: &std::path::Path, what: &'static str, err: std::io::Error) -> OciError {
        OciError::Io {
            path: path.to_path_buf(),
            what,
            err,
        }
    }
}
