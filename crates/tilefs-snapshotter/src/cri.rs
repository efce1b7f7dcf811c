//! CRI's image service (runtime.v1), served on the snapshotter's socket
//! as a proxy in front of containerd's (`[cri_keychain]` in the config):
//! the kubelet (`--image-service-endpoint`) or crictl (`--image-endpoint`)
//! asks it, and each call goes on to containerd unchanged. Before a
//! PullImage goes on, the credentials it carries (a pod's
//! imagePullSecrets, `crictl pull --creds`) are kept for the image's
//! repository in the process's keychain
//! ([`tilefs_oci::transport::keychain`]): the lazy path's fetches for that
//! image, which containerd's Prepare calls start while the pull is under
//! way, use them, and so do the FUSE servers of its snapshots, which are
//! handed them through a pipe. They are kept in memory only, never
//! written or logged.
//!
//! The proxy also says what the snapshotter makes of each image: a
//! PullImage is judged by the snapshotter's signature policy before it
//! goes on (a refusal fails it, with the policy's reason: containerd
//! would otherwise unpack the image whole), and ImageStatus with
//! `verbose` (`crictl inspecti`) carries in its `info` under
//! [`INFO_KEY`] whether the image was served lazily, and how, or why it
//! was pulled whole.

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::image_service_server::{ImageService, ImageServiceServer};
use k8s_cri::v1::{
    AuthConfig, ImageFsInfoRequest, ImageFsInfoResponse, ImageStatusRequest, ImageStatusResponse, ListImagesRequest,
    ListImagesResponse, PullImageRequest, PullImageResponse, RemoveImageRequest, RemoveImageResponse,
};
use std::path::{Path, PathBuf};
use tilefs_oci::transport::keychain::{self, Secret};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Response, Status};

/// The proxy: a client of containerd's image service, and the snapshotter.
pub struct Proxy {
    backend: ImageServiceClient<Channel>,
    snap: crate::Tilefs,
}

/// The key of ImageStatus's `info` (verbose) that says how the image is
/// served: a JSON object (crictl shows only those), `{"lazy": BOOL,
/// "message": "lazy: …" or "pulled whole: …"}`.
pub const INFO_KEY: &str = "tilefs";

/// The image service to serve, forwarding to the one at `backend` (a unix
/// socket: containerd's), which is connected to on the first call (and
/// again after it restarts).
pub fn server(backend: &Path, snap: crate::Tilefs) -> ImageServiceServer<Proxy> {
    let path: PathBuf = backend.to_path_buf();
    // The URI is unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://containerd.invalid").connect_with_connector_lazy(tower::service_fn(
        move |_: Uri| tokio::net::UnixStream::connect(path.clone()),
    ));
    ImageServiceServer::new(Proxy {
        backend: ImageServiceClient::new(channel),
        snap,
    })
}

/// The secret CRI's `auth` gives, if it gives one: a registry token, else
/// an identity token (an OAuth2 refresh token, exchanged at the token
/// server), else a user and password (or `auth`, their base64).
pub fn secret_of(auth: &AuthConfig) -> Option<Secret> {
    if !auth.registry_token.is_empty() {
        return Some(Secret::Token(auth.registry_token.clone()));
    }
    if !auth.identity_token.is_empty() {
        return Some(Secret::Identity(auth.identity_token.clone()));
    }
    if !auth.username.is_empty() {
        return Some(Secret::Basic {
            user: auth.username.clone(),
            password: auth.password.clone(),
        });
    }
    use base64::Engine;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.auth.trim())
        .ok()?;
    let (user, password) = std::str::from_utf8(&decoded).ok()?.split_once(':')?;
    (!user.is_empty()).then(|| Secret::Basic {
        user: user.to_string(),
        password: password.to_string(),
    })
}

/// `r`'s message, for the backend (metadata is the caller's connection's).
fn onward<T>(r: Request<T>) -> Request<T> {
    Request::new(r.into_inner())
}

#[tonic::async_trait]
impl ImageService for Proxy {
    async fn list_images(&self, r: Request<ListImagesRequest>) -> Result<Response<ListImagesResponse>, Status> {
        self.backend.clone().list_images(onward(r)).await
    }

    async fn image_status(&self, r: Request<ImageStatusRequest>) -> Result<Response<ImageStatusResponse>, Status> {
        let verbose = r.get_ref().verbose;
        let mut answer = self.backend.clone().image_status(onward(r)).await?;
        // containerd fills `info` only when asked for it (verbose): so does
        // the proxy.
        let said = answer
            .get_ref()
            .image
            .as_ref()
            .filter(|_| verbose)
            .and_then(|i| self.snap.said_of(&i.repo_digests));
        if let Some((lazy, message)) = said {
            let value = serde_json::json!({ "lazy": lazy, "message": message });
            answer.get_mut().info.insert(INFO_KEY.to_string(), value.to_string());
        }
        Ok(answer)
    }

    async fn pull_image(&self, r: Request<PullImageRequest>) -> Result<Response<PullImageResponse>, Status> {
        let req = r.get_ref();
        if let (Some(image), Some(auth)) = (&req.image, &req.auth) {
            if let Some(secret) = secret_of(auth) {
                // A name the registry client cannot parse is refused by
                // containerd too; it says why.
                let _ = keychain::remember(&image.image, secret);
            }
        }
        if let Some(image) = req.image.as_ref().map(|i| i.image.clone()) {
            let snap = self.snap.clone();
            let name = image.clone();
            let judged = tokio::task::spawn_blocking(move || snap.before_pull(&name))
                .await
                .map_err(|e| Status::internal(format!("the snapshotter's worker failed: {e}")))?;
            if let Err(why) = judged {
                return Err(Status::permission_denied(format!(
                    "{image}: the tilefs snapshotter's signature policy refuses it: {why}"
                )));
            }
        }
        self.backend.clone().pull_image(onward(r)).await
    }

    async fn remove_image(&self, r: Request<RemoveImageRequest>) -> Result<Response<RemoveImageResponse>, Status> {
        self.backend.clone().remove_image(onward(r)).await
    }

    async fn image_fs_info(&self, r: Request<ImageFsInfoRequest>) -> Result<Response<ImageFsInfoResponse>, Status> {
        self.backend.clone().image_fs_info(onward(r)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_from_each_field() {
        let a = |f: &dyn Fn(&mut AuthConfig)| {
            let mut c = AuthConfig::default();
            f(&mut c);
            secret_of(&c)
        };
        assert_eq!(a(&|_| {}), None);
        assert_eq!(
            a(&|c| {
                c.username = "u".into();
                c.password = "p".into()
            }),
            Some(Secret::Basic {
                user: "u".into(),
                password: "p".into()
            })
        );
        assert_eq!(
            a(&|c| c.auth = "dTpwOnE=".into()),
            Some(Secret::Basic {
                user: "u".into(),
                password: "p:q".into()
            })
        );
        assert_eq!(a(&|c| c.auth = "not base64!".into()), None);
        assert_eq!(a(&|c| c.registry_token = "t".into()), Some(Secret::Token("t".into())));
        assert_eq!(
            a(&|c| c.identity_token = "t".into()),
            Some(Secret::Identity("t".into()))
        );
    }
}
