//! Credentials handed to this process for one image's repository (the
//! AuthConfig of a CRI PullImage, which the snapshotter's image service
//! proxy keeps; see tilefs_snapshotter::cri), kept in memory only: never
//! written to a file or a log. [`super::registry::Registry::open`] asks
//! here before the credential files of [`super::auth`].
//!
//! Entries are keyed by registry host and repository, as the registry
//! client resolves them, and sent to that host only (not to a mirror of
//! it: a mirror that wants credentials has its own in the files). At most
//! [`MAX`] are kept; the least recently given goes first.

use std::collections::HashMap;
use std::sync::Mutex;

/// A secret for one repository.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Secret {
    /// A user name and password, sent as the registry's challenge asks
    /// (Basic, or exchanged for a Bearer token).
    Basic { user: String, password: String },
    /// A Bearer token sent as it is (CRI's `registry_token`).
    Token(String),
    /// An OAuth2 refresh token (CRI's `identity_token`, auth.json's
    /// `identitytoken`), exchanged at the token server the registry's
    /// challenge names for a Bearer token.
    Identity(String),
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Secret::Basic { user, .. } => write!(f, "Basic({user}, <hidden>)"),
            Secret::Token(_) => write!(f, "Token(<hidden>)"),
            Secret::Identity(_) => write!(f, "Identity(<hidden>)"),
        }
    }
}

/// An entry: what [`export`] hands to another process and [`import`] takes.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Entry {
    pub registry: String,
    pub repository: String,
    pub secret: Secret,
}

/// Most entries kept.
pub const MAX: usize = 512;

struct Keychain {
    entries: HashMap<(String, String), (u64, Secret)>,
    next: u64,
}

static KEYCHAIN: Mutex<Option<Keychain>> = Mutex::new(None);

/// The registry host and repository of `image` (`HOST/PATH[:TAG][@DIGEST]`,
/// `docker://` allowed), as the registry client resolves them.
pub fn key_of(image: &str) -> Result<(String, String), String> {
    let image = image.strip_prefix("docker://").unwrap_or(image);
    let r: oci_client::Reference = image
        .parse()
        .map_err(|e| format!("invalid image reference {image:?}: {e}"))?;
    Ok((r.resolve_registry().to_string(), r.repository().to_string()))
}

/// Keeps `secret` for the repository of `image`.
pub fn remember(image: &str, secret: Secret) -> Result<(), String> {
    let (registry, repository) = key_of(image)?;
    import(Entry {
        registry,
        repository,
        secret,
    });
    Ok(())
}

/// Keeps `e`, evicting the oldest entry past [`MAX`].
pub fn import(e: Entry) {
    let mut k = KEYCHAIN.lock().unwrap_or_else(|e| e.into_inner());
    let k = k.get_or_insert_with(|| Keychain {
        entries: HashMap::new(),
        next: 0,
    });
    k.next += 1;
    k.entries.insert((e.registry, e.repository), (k.next, e.secret));
    while k.entries.len() > MAX {
        let oldest = k
            .entries
            .iter()
            .min_by_key(|(_, (n, _))| *n)
            .map(|(key, _)| key.clone());
        match oldest {
            Some(key) => k.entries.remove(&key),
            None => break,
        };
    }
}

/// The secret kept for `repository` of `registry`, if any.
pub fn lookup(registry: &str, repository: &str) -> Option<Secret> {
    let k = KEYCHAIN.lock().unwrap_or_else(|e| e.into_inner());
    k.as_ref()?
        .entries
        .get(&(registry.to_string(), repository.to_string()))
        .map(|(_, s)| s.clone())
}

/// The entry for `image`'s repository, to hand to a process of ours
/// that fetches for it (through a pipe, never a file or an argument).
pub fn export(image: &str) -> Option<Entry> {
    let (registry, repository) = key_of(image).ok()?;
    let secret = lookup(&registry, &repository)?;
    Some(Entry {
        registry,
        repository,
        secret,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_by_repository_and_bounded() {
        remember(
            "127.0.0.1:5999/team/app:v1",
            Secret::Basic {
                user: "u".into(),
                password: "s3cret".into(),
            },
        )
        .unwrap();
        assert!(lookup("127.0.0.1:5999", "team/app").is_some());
        assert!(lookup("127.0.0.1:5999", "team/other").is_none());
        let e = export(&format!("docker://127.0.0.1:5999/team/app@sha256:{}", "a".repeat(64))).unwrap();
        assert_eq!(e.repository, "team/app");
        assert!(!format!("{e:?}").contains("s3cret"), "Debug shows no secret");
        for i in 0..MAX + 10 {
            remember(&format!("127.0.0.1:5998/r{i}"), Secret::Token("t".into())).unwrap();
        }
        assert!(lookup("127.0.0.1:5999", "team/app").is_none(), "the oldest went first");
        assert!(lookup("127.0.0.1:5998", &format!("r{}", MAX + 9)).is_some());
    }
}
