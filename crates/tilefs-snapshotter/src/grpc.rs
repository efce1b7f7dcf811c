//! containerd's snapshots API (`containerd.services.snapshots.v1`) over
//! the state machine: each call run on a thread that may block, each
//! error given the gRPC code containerd's errdefs read (here, once).

use crate::error::Error;
use crate::layer::LayerError;
use crate::state::SnapKind;
use crate::Tilefs;
use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Snapshotter, Usage};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use tilefs_commit::CommitError;
use tilefs_store::StoreError;
use tonic::{Code, Status};

/// The gRPC code containerd reads `e` as.
pub fn code(e: &Error) -> Code {
    match e {
        Error::NotFound(_) | Error::ParentNotFound(_) => Code::NotFound,
        Error::AlreadyExists(_) | Error::ServedLazily(_) => Code::AlreadyExists,
        Error::NotActive(_) | Error::NoMounts(_) | Error::HasChild { .. } => Code::FailedPrecondition,
        Error::Empty(_) | Error::ParentNotCommitted(_) | Error::Immutable { .. } | Error::Filter(_) => {
            Code::InvalidArgument
        }
        Error::Lazy(_) => Code::Unavailable,
        Error::Refused(_) => Code::PermissionDenied,
        Error::Context { error, .. } => code(error),
        Error::Layer(e) => layer_code(e),
        Error::Store(e) => store_code(e),
        Error::Io { err, .. } => io_code(err),
        Error::Oci(_) | Error::Broken(_) => Code::Internal,
    }
}

/// A snapshot's upper directory that could not be read as a layer.
fn layer_code(e: &LayerError) -> Code {
    match e {
        LayerError::Read(CommitError::Io { err, .. }) => io_code(err),
        LayerError::Read(CommitError::Store(e)) | LayerError::Import { err: e, .. } => store_code(e),
        LayerError::Read(CommitError::At { .. }) => Code::Internal,
        // The upper directory is not one overlayfs made over its parents.
        LayerError::MetacopyWithoutData { .. } | LayerError::MetacopySize { .. } => Code::FailedPrecondition,
        // Written to while committed: another Commit may find it still.
        LayerError::ChangedSize { .. } => Code::Aborted,
        LayerError::Threads(_) => Code::ResourceExhausted,
    }
}

fn store_code(e: &StoreError) -> Code {
    match e {
        StoreError::Io { err, .. } | StoreError::SourceIo { err, .. } => io_code(err),
        // A gc or build holds the store: asking again later succeeds.
        StoreError::Busy(_) => Code::Unavailable,
        StoreError::Interrupted => Code::Cancelled,
        StoreError::Source { .. } => Code::Aborted,
        StoreError::Invalid(_) | StoreError::Mismatch(_) => Code::Internal,
    }
}

/// A full disk or quota is the one failure of the system the caller can
/// act on.
fn io_code(e: &std::io::Error) -> Code {
    match e.kind() {
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => Code::ResourceExhausted,
        _ => Code::Internal,
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(code(&e), e.to_string())
    }
}

type Result<T> = crate::Result<T>;

/// Runs `f` on a thread that may block.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Broken(format!("the snapshotter's worker failed: {e}")))?
}

#[tonic::async_trait]
impl Snapshotter for Tilefs {
    type Error = Error;

    async fn stat(&self, key: String) -> Result<Info> {
        let s = self.s.clone();
        blocking(move || s.stat(&key)).await
    }

    async fn update(&self, info: Info, fieldpaths: Option<Vec<String>>) -> Result<Info> {
        let s = self.s.clone();
        blocking(move || s.update(info, fieldpaths)).await
    }

    async fn usage(&self, key: String) -> Result<Usage> {
        let s = self.s.clone();
        blocking(move || s.usage(&key)).await
    }

    async fn mounts(&self, key: String) -> Result<Vec<Mount>> {
        let s = self.s.clone();
        blocking(move || s.mounts(&key)).await
    }

    async fn prepare(&self, key: String, parent: String, labels: HashMap<String, String>) -> Result<Vec<Mount>> {
        let s = self.s.clone();
        blocking(move || s.create(key, parent, labels, SnapKind::Active)).await
    }

    async fn view(&self, key: String, parent: String, labels: HashMap<String, String>) -> Result<Vec<Mount>> {
        let s = self.s.clone();
        blocking(move || s.create(key, parent, labels, SnapKind::View)).await
    }

    async fn commit(&self, name: String, key: String, labels: HashMap<String, String>) -> Result<()> {
        let s = self.s.clone();
        blocking(move || s.commit(name, key, labels)).await
    }

    async fn remove(&self, key: String) -> Result<()> {
        let s = self.s.clone();
        blocking(move || s.remove(&key)).await
    }

    async fn clear(&self) -> Result<()> {
        let s = self.s.clone();
        blocking(move || s.cleanup()).await
    }

    type InfoStream = tokio_stream::Iter<std::vec::IntoIter<Result<Info>>>;

    async fn list(&self, _snapshotter: String, filters: Vec<String>) -> Result<Self::InfoStream> {
        let s = self.s.clone();
        let infos = blocking(move || s.list(&filters)).await?;
        Ok(tokio_stream::iter(infos.into_iter().map(Ok).collect::<Vec<_>>()))
    }
}

/// The snapshotter's gRPC services: containerd's snapshots API, and CRI's
/// image service as a proxy in front of containerd's at
/// `cri_image_service` ([`crate::cri`]).
pub fn router(snap: Tilefs, cri_image_service: Option<&Path>) -> tonic::transport::server::Router {
    let images = cri_image_service.map(|b| crate::cri::server(b, snap.clone()));
    tonic::transport::Server::builder()
        .add_service(containerd_snapshots::server(Arc::new(snap)))
        .add_optional_service(images)
}

/// Serves [`router`] on `listener` until `shutdown` is ready; then the
/// calls under way finish.
pub async fn serve(
    snap: Tilefs,
    cri_image_service: Option<&Path>,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::result::Result<(), tonic::transport::Error> {
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    router(snap, cri_image_service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_failures_get_the_codes_a_caller_can_act_on() {
        let import = |err| {
            crate::Error::from(LayerError::Import {
                path: "/u/f".into(),
                err,
            })
        };
        let io = |kind| tilefs_store::StoreError::io(Path::new("/s"), "cannot write", std::io::Error::from(kind));
        let cases = [
            (import(io(std::io::ErrorKind::StorageFull)), Code::ResourceExhausted),
            (import(io(std::io::ErrorKind::PermissionDenied)), Code::Internal),
            (import(tilefs_store::StoreError::Busy("/s".into())), Code::Unavailable),
            (import(tilefs_store::StoreError::Interrupted), Code::Cancelled),
            (LayerError::ChangedSize { path: "/u/f".into() }.into(), Code::Aborted),
        ];
        for (e, want) in cases {
            let shown = e.to_string();
            assert_eq!(code(&e.context("commit")), want, "{shown}");
        }
    }
}
