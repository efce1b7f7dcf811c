//! The mount service's policy: which users may have which stores' tagged
//! images mounted by the kernel, and how.
//!
//! ```toml
//! max_mounts_per_user = 64          # optional: live mounts the service keeps for one user
//!
//! [[store]]
//! path = "/var/lib/tilefs/store"   # absolute; the store's images/ tags
//! users = ["alice"]                 # user names allowed
//! groups = ["builders"]             # group names allowed (primary or supplementary)
//! images = ["os:1", "os:2"]         # optional: only these tags (default: every tag)
//! verity = "auto"                   # require | auto | off (default auto)
//! writable = true                   # allow --upper/--work (default false)
//! signature_policy = "/etc/containers/policy.json"  # optional: mount only images this
//!                                   # containers-policy.json accepts, judged by the
//!                                   # record of the checked pull that brought them in
//! [store.pinned]                    # optional: a tag is mounted only with this digest
//! "os:1" = "sha256:0123…"
//! ```
//!
//! Unknown keys are errors: a typo must not silently widen or narrow
//! what is allowed.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    #[serde(default, rename = "store")]
    pub stores: Vec<StoreRule>,
    /// Live mounts the service keeps for one user (default 64).
    #[serde(default)]
    pub max_mounts_per_user: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreRule {
    pub path: PathBuf,
    #[serde(default)]
    pub users: Vec<String>,
    #[serde(default)]
    pub groups: Vec<String>,
    #[serde(default)]
    pub images: Vec<String>,
    #[serde(default)]
    pub verity: Option<String>,
    #[serde(default)]
    pub writable: bool,
    #[serde(default)]
    pub pinned: BTreeMap<String, String>,
    /// A containers-policy.json every image mounted from the store must
    /// pass (read at each request, so an edit applies to the next mount).
    #[serde(default)]
    pub signature_policy: Option<PathBuf>,
    /// `users` and `groups` as ids, resolved once when the policy is read:
    /// a request is never refused because the user database could not be
    /// read at that moment.
    #[serde(skip)]
    uids: Vec<u32>,
    #[serde(skip)]
    gids: Vec<u32>,
}

/// Who asks: from the socket's peer credentials, never from the request.
#[derive(Debug, Clone)]
pub struct Caller {
    pub uid: u32,
    pub gids: Vec<u32>,
    pub pid: i32,
}

impl Policy {
    /// Reads and checks a policy file: only if root alone could have
    /// written it (see [`tilefs_trust::rootfile`]).
    pub fn load(path: &Path) -> Result<Policy, String> {
        let bytes = tilefs_trust::rootfile::read_existing(path, tilefs_trust::MAX_CONFIG).map_err(|e| e.to_string())?;
        let text = String::from_utf8(bytes).map_err(|_| format!("{}: not UTF-8", path.display()))?;
        Policy::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Policy, String> {
        let mut p: Policy = toml::from_str(text).map_err(|e| e.to_string())?;
        for s in &mut p.stores {
            // A name that names nobody is a mistake to fix, not to ignore.
            for u in &s.users {
                let uid = uid_of(u).ok_or_else(|| format!("store {}: no user {u:?}", s.path.display()))?;
                s.uids.push(uid);
            }
            for g in &s.groups {
                let gid = gid_of(g).ok_or_else(|| format!("store {}: no group {g:?}", s.path.display()))?;
                s.gids.push(gid);
            }
            if !s.path.is_absolute() {
                return Err(format!("store path {:?} is not absolute", s.path));
            }
            if let Some(v) = &s.verity {
                v.parse::<crate::Verity>()?;
            }
            if let Some(sp) = &s.signature_policy {
                if !sp.is_absolute() {
                    return Err(format!(
                        "store {}: signature_policy {sp:?} is not absolute",
                        s.path.display()
                    ));
                }
                // A policy that does not parse now (or that the service
                // cannot trust) would refuse every mount.
                tilefs_trust::Policy::load_roots(sp).map_err(|e| format!("store {}: {e}", s.path.display()))?;
            }
            for (tag, d) in &s.pinned {
                crate::options::parse_digest(d).map_err(|e| format!("pinned {tag:?}: {e}"))?;
            }
        }
        Ok(p)
    }

    /// Whether any rule names `caller` (by user or group): others are
    /// turned away before their request is read.
    pub fn lists(&self, caller: &Caller) -> bool {
        self.stores.iter().any(|r| r.names(caller))
    }

    /// The rule that lets `caller` mount tag `image` of `store`, or why
    /// none does (naming the rule that refused, but not whom it allows:
    /// any local user may ask).
    pub fn allow(&self, caller: &Caller, store: &Path, image: &str) -> Result<&StoreRule, String> {
        let rule = self
            .stores
            .iter()
            .find(|s| s.path == store)
            .ok_or_else(|| format!("store {} is not listed in the policy", store.display()))?;
        if !rule.names(caller) {
            return Err(format!(
                "uid {} is not among the users or groups the policy allows for store {}",
                caller.uid,
                store.display()
            ));
        }
        if !rule.images.is_empty() && !rule.images.iter().any(|i| i == image) {
            return Err(format!(
                "image {image:?} is not among the images {:?} the policy allows in store {}",
                rule.images,
                store.display()
            ));
        }
        Ok(rule)
    }
}

impl StoreRule {
    /// Whether the rule names `caller`, as a user or by one of its groups.
    fn names(&self, caller: &Caller) -> bool {
        self.uids.contains(&caller.uid) || self.gids.iter().any(|g| caller.gids.contains(g))
    }
}

/// The uid of a user name (or a number), from the system's user database.
fn uid_of(name: &str) -> Option<u32> {
    name.parse().ok().or_else(|| tilefs_sys::users::uid_of(name))
}

/// The gid of a group name (or a number), from the system's group database.
fn gid_of(name: &str) -> Option<u32> {
    name.parse().ok().or_else(|| tilefs_sys::users::gid_of(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = r#"
[[store]]
path = "/s"
users = ["root", "1234"]
images = ["a"]
[store.pinned]
"a" = "sha256:abababababababababababababababababababababababababababababababab"

[[store]]
path = "/t"
groups = ["root"]
"#;

    #[test]
    fn allows_by_user_group_and_image() {
        let p = Policy::parse(P).unwrap();
        let who = |uid, gids: &[u32]| Caller {
            uid,
            gids: gids.to_vec(),
            pid: 1,
        };
        assert!(p.allow(&who(0, &[5]), Path::new("/s"), "a").is_ok());
        assert!(p.allow(&who(1234, &[5]), Path::new("/s"), "a").is_ok());
        let e = p.allow(&who(1234, &[5]), Path::new("/s"), "b").unwrap_err();
        assert!(e.contains("not among the images"), "{e}");
        let e = p.allow(&who(99, &[99]), Path::new("/s"), "a").unwrap_err();
        assert!(e.contains("not among the users"), "{e}");
        assert!(p.allow(&who(99, &[0]), Path::new("/t"), "x").is_ok());
        let e = p.allow(&who(0, &[0]), Path::new("/u"), "x").unwrap_err();
        assert!(e.contains("not listed"), "{e}");
    }

    #[test]
    fn strict() {
        for bad in [
            "[[store]]\npath = \"/s\"\nuser = [\"x\"]\n",
            "[[store]]\npath = \"rel\"\n",
            "[[store]]\npath = \"/s\"\nverity = \"maybe\"\n",
            "[[store]]\npath = \"/s\"\n[store.pinned]\n\"a\" = \"abc\"\n",
            "stores = 1\n",
            "[[store]]\npath = \"/s\"\nusers = [\"no-such-user-here\"]\n",
            "[[store]]\npath = \"/s\"\ngroups = [\"no-such-group-here\"]\n",
        ] {
            assert!(Policy::parse(bad).is_err(), "{bad}");
        }
        assert!(Policy::parse("").unwrap().stores.is_empty());
    }
}
