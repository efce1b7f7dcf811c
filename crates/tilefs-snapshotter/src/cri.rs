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

/// The proxy: a client of containerd's image service.
pub struct Proxy {
    backend: ImageServiceClient<Channel>,
}

/// The image service to serve, forwarding to the one at `backend` (a unix
/// socket: containerd's), which is connected to on the first call (and
/// again after it restarts).
pub fn server(backend: &Path) -> ImageServiceServer<Proxy> {
    let path: PathBuf = backend.to_path_buf();
    // The URI is unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://containerd.invalid").connect_with_connector_lazy(tower::service_fn(
        move |_: Uri| tokio::net::UnixStream::connect(path.clone()),
    ));
    ImageServiceServer::new(Proxy {
        backend: ImageServiceClient::new(channel),
    })
}

/// The secret CRI's `auth` gives, if it gives one that is used: a
/// registry token, else a user and password (or `auth`, their base64).
/// An identity token (an OAuth2 refresh token) is not.
pub fn secret_of(auth: &AuthConfig) -> Option<Secret> {
    if !auth.registry_token.is_empty() {
        return Some(Secret::Token(auth.registry_token.clone()));
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
        self.backend.clone().image_status(onward(r)).await
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
        assert_eq!(a(&|c| c.identity_token = "t".into()), None);
    }
}
