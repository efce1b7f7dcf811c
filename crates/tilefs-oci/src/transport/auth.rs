//! Registry credentials, from the files podman and skopeo read, in
//! containers/image's order: `$REGISTRY_AUTH_FILE` alone when it is set;
//! otherwise `$XDG_RUNTIME_DIR/containers/auth.json` (where `podman login`
//! writes; without `$XDG_RUNTIME_DIR`, `/run/containers/UID/auth.json`,
//! root's), `$XDG_CONFIG_HOME/containers/auth.json` (default
//! `~/.config`), `$DOCKER_CONFIG/config.json` (default `~/.docker`). The
//! first file with an entry for the image wins. In a file, the most
//! specific key wins: `HOST/NAMESPACE/REPO`, then each namespace above
//! it, then `HOST`, then a key naming the host with a scheme or path
//! (`https://index.docker.io/v1/`); Docker Hub is `docker.io` under any of
//! its names. An entry holds `auth`: base64 of `USER:PASSWORD`, or
//! `identitytoken`: an OAuth2 refresh token (what `docker login` keeps for
//! registries that hand one out), used in its place when present.

use super::keychain::Secret;
use crate::OciError;
use base64::Engine;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(Deserialize)]
struct AuthFile {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

/// The files searched, in order.
pub fn auth_files() -> Vec<PathBuf> {
    files_for(|k| std::env::var_os(k), rustix::process::getuid().as_raw())
}

/// What tells a credential file's versions apart: its path, and its
/// inode, size and modification time (None while it does not exist).
pub type FileState = (PathBuf, Option<(u64, u64, i64, i64)>);

/// The state of each file of [`auth_files`], to see that one changed (a
/// `podman login` wrote it) without reading them.
pub fn files_state() -> Vec<FileState> {
    use std::os::unix::fs::MetadataExt;
    auth_files()
        .into_iter()
        .map(|p| {
            let m = std::fs::metadata(&p).ok();
            let s = m.map(|m| (m.ino(), m.size(), m.mtime(), m.mtime_nsec()));
            (p, s)
        })
        .collect()
}

/// [`auth_files`] for an environment `var` and a user id.
fn files_for(var: impl Fn(&str) -> Option<OsString>, uid: u32) -> Vec<PathBuf> {
    let set = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = set("REGISTRY_AUTH_FILE") {
        return vec![p];
    }
    let mut v = vec![match set("XDG_RUNTIME_DIR") {
        Some(d) => d.join("containers/auth.json"),
        None => PathBuf::from(format!("/run/containers/{uid}/auth.json")),
    }];
    let home = set("HOME");
    if let Some(config) = set("XDG_CONFIG_HOME").or_else(|| home.as_ref().map(|h| h.join(".config"))) {
        v.push(config.join("containers/auth.json"));
    }
    if let Some(docker) = set("DOCKER_CONFIG").or_else(|| home.as_ref().map(|h| h.join(".docker"))) {
        v.push(docker.join("config.json"));
    }
    v
}

/// Credentials found for a registry, and the file they came from.
pub struct Credentials {
    /// A user name and password, or an identity token.
    pub secret: Secret,
    pub file: PathBuf,
}

/// The credentials for `repository` (`NAMESPACE/REPO`) on `registry`
/// (`HOST[:PORT]`), if a file has them.
pub fn credentials(registry: &str, repository: &str) -> Result<Option<Credentials>, OciError> {
    let registry = hub(registry);
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
        let Some((key, entry)) = entry_for(&file, registry, repository) else {
            continue;
        };
        let bad = |why: &str| OciError::manifest(path.display().to_string(), format!("entry {key:?}: {why}"));
        if let Some(t) = entry.identitytoken.as_deref().filter(|t| !t.is_empty()) {
            return Ok(Some(Credentials {
                secret: Secret::Identity(t.to_string()),
                file: path,
            }));
        }
        let auth = entry.auth.as_deref().unwrap_or_default();
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| bad("auth is not base64"))?;
        let decoded = String::from_utf8(decoded).map_err(|_| bad("auth is not UTF-8"))?;
        let (user, pass) = decoded
            .split_once(':')
            .ok_or_else(|| bad("auth is not USER:PASSWORD"))?;
        return Ok(Some(Credentials {
            secret: Secret::Basic {
                user: user.to_string(),
                password: pass.to_string(),
            },
            file: path,
        }));
    }
    Ok(None)
}

/// The key and entry of `file` for `registry/repository` (one with `auth`
/// or `identitytoken`): the most specific key, else one naming the host
/// in another spelling.
fn entry_for<'a>(file: &'a AuthFile, registry: &str, repository: &str) -> Option<(&'a str, &'a AuthEntry)> {
    let has = |e: &AuthEntry| {
        [&e.auth, &e.identitytoken]
            .iter()
            .any(|v| v.as_deref().is_some_and(|v| !v.is_empty()))
    };
    let with_auth = |(k, e): (&'a String, &'a AuthEntry)| has(e).then_some((k.as_str(), e));
    let mut key = format!("{registry}/{repository}");
    loop {
        if let Some(found) = file.auths.get_key_value(&key).and_then(with_auth) {
            return Some(found);
        }
        match key.rfind('/') {
            Some(i) => key.truncate(i),
            None => break,
        }
    }
    file.auths
        .iter()
        .filter(|(k, _)| hub(host_of(k)) == registry)
        .find_map(with_auth)
}

/// `https://host:port/v1/` -> `host:port`.
fn host_of(key: &str) -> &str {
    let k = key.split_once("://").map_or(key, |(_, rest)| rest);
    k.split('/').next().unwrap_or(k)
}

/// Docker Hub's names, as `docker.io` (what `podman login` writes).
fn hub(host: &str) -> &str {
    match host {
        "index.docker.io" | "registry-1.docker.io" => "docker.io",
        h => h,
    }
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

    #[test]
    fn the_most_specific_entry_wins_as_in_containers_image() {
        let e = |user: &str| {
            format!(
                r#"{{"auth": "{}"}}"#,
                base64::engine::general_purpose::STANDARD.encode(user)
            )
        };
        let file: AuthFile = serde_json::from_str(&format!(
            r#"{{"auths": {{"quay.io": {0}, "quay.io/team": {1}, "quay.io/team/app": {2},
                "https://index.docker.io/v1/": {3}, "other.io/x": {{}}}}}}"#,
            e("host:p"),
            e("team:p"),
            e("app:p"),
            e("hub:p")
        ))
        .unwrap();
        let key = |reg, repo| entry_for(&file, reg, repo).map(|(k, _)| k);
        assert_eq!(key("quay.io", "team/app"), Some("quay.io/team/app"));
        assert_eq!(key("quay.io", "team/db"), Some("quay.io/team"));
        assert_eq!(key("quay.io", "solo/app"), Some("quay.io"));
        assert_eq!(
            key(hub("registry-1.docker.io"), "library/busybox"),
            Some("https://index.docker.io/v1/")
        );
        assert_eq!(key("other.io", "x"), None, "an entry without auth is none");
    }

    #[test]
    fn files_are_searched_as_podman_searches_them() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
        };
        let paths = |v: Vec<PathBuf>| v.iter().map(|p| p.display().to_string()).collect::<Vec<_>>();
        assert_eq!(
            paths(files_for(env(&[("REGISTRY_AUTH_FILE", "/a.json"), ("HOME", "/h")]), 0)),
            ["/a.json"]
        );
        assert_eq!(
            paths(files_for(env(&[("HOME", "/root")]), 0)),
            [
                "/run/containers/0/auth.json",
                "/root/.config/containers/auth.json",
                "/root/.docker/config.json"
            ]
        );
        assert_eq!(
            paths(files_for(
                env(&[
                    ("XDG_RUNTIME_DIR", "/run/user/7"),
                    ("XDG_CONFIG_HOME", "/c"),
                    ("DOCKER_CONFIG", "/d"),
                    ("HOME", "/h")
                ]),
                7
            )),
            [
                "/run/user/7/containers/auth.json",
                "/c/containers/auth.json",
                "/d/config.json"
            ]
        );
    }
}
