//! Registry credentials, from the files podman and skopeo read:
//! `$REGISTRY_AUTH_FILE`, `$XDG_RUNTIME_DIR/containers/auth.json`,
//! `~/.config/containers/auth.json`, `~/.docker/config.json`; the first
//! file with an entry for the registry wins. Entries are keyed by
//! `HOST[:PORT]` (a scheme or a path after it is ignored), and hold
//! `auth`: base64 of `USER:PASSWORD`.

use crate::OciError;
use base64::Engine;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct AuthFile {
    #[serde(default)]
    auths: HashMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
}

/// The files searched, in order.
pub fn auth_files() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("REGISTRY_AUTH_FILE") {
        v.push(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("XDG_RUNTIME_DIR") {
        v.push(Path::new(&p).join("containers/auth.json"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        let home = PathBuf::from(home);
        v.push(home.join(".config/containers/auth.json"));
        v.push(home.join(".docker/config.json"));
    }
    v
}

/// Credentials found for a registry, and the file they came from.
pub struct Credentials {
    pub user: String,
    pub password: String,
    pub file: PathBuf,
}

/// The user name and password for `registry` (`HOST[:PORT]`), if a file
/// has them.
pub fn credentials(registry: &str) -> Result<Option<Credentials>, OciError> {
    for path in auth_files() {
        // Not blocking on a FIFO put where the file should be.
        let raw = tilefs_store::open_regular(rustix::fs::CWD, &path, true).and_then(|mut f| {
            let mut v = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut v).map(|_| v)
        });
        let raw = match raw {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(OciError::io(&path, "cannot read the credentials file", e)),
        };
        let file: AuthFile = serde_json::from_slice(&raw)
            .map_err(|e| OciError::manifest(path.display().to_string(), format!("not a credentials file: {e}")))?;
        for (key, entry) in &file.auths {
            if host_of(key) != registry && !(registry == "registry-1.docker.io" && host_of(key) == "index.docker.io") {
                continue;
            }
            let Some(auth) = &entry.auth else { continue };
            let bad = |why: &str| OciError::manifest(path.display().to_string(), format!("entry {key:?}: {why}"));
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .map_err(|_| bad("auth is not base64"))?;
            let decoded = String::from_utf8(decoded).map_err(|_| bad("auth is not UTF-8"))?;
            let (user, pass) = decoded
                .split_once(':')
                .ok_or_else(|| bad("auth is not USER:PASSWORD"))?;
            return Ok(Some(Credentials {
                user: user.to_string(),
                password: pass.to_string(),
                file: path,
            }));
        }
    }
    Ok(None)
}

/// `https://host:port/v1/` -> `host:port`.
fn host_of(key: &str) -> &str {
    let k = key.split_once("://").map_or(key, |(_, rest)| rest);
    k.split('/').next().unwrap_or(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_by_host() {
        assert_eq!(host_of("https://index.docker.io/v1/"), "index.docker.io");
        assert_eq!(host_of("127.0.0.1:5000"), "127.0.0.1:5000");
        assert_eq!(host_of("quay.io/team"), "quay.io");
    }
}
