//! Docker references (`[HOST[:PORT]/]PATH[:TAG][@DIGEST]`) by the grammar
//! of the distribution project's reference package, in the fully expanded
//! form that policies, registries.d and signatures use: `busybox` is
//! `docker.io/library/busybox`, `index.docker.io` is `docker.io`.
//!
//! A host name is a DNS name, which has no case: it is kept in lower case
//! (`LOCALHOST:5000/x` is `localhost:5000/x`), so that every comparison
//! with a scope, a registries.d key, a registries.conf prefix or a
//! signature's claimed identity is made without regard to it. A
//! repository path is compared as written (the grammar allows no capitals
//! in it).

use std::fmt;

/// The longest repository name (domain and path) a reference may have.
pub const NAME_TOTAL_MAX: usize = 255;

/// A named reference, normalized.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DockerRef {
    /// `HOST[:PORT]`.
    pub domain: String,
    /// The repository path within the registry (`library/busybox`).
    pub path: String,
    pub tag: Option<String>,
    /// `ALGORITHM:HEX`.
    pub digest: Option<String>,
}

/// Why a string is not a reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid docker reference {input:?}: {why}")]
pub struct RefError {
    pub input: String,
    pub why: String,
}

fn err(input: &str, why: impl Into<String>) -> RefError {
    RefError {
        input: input.to_string(),
        why: why.into(),
    }
}

/// Whether the first component of a name is a registry host (it has a dot
/// or a port, is `localhost`, or has upper case letters, which a path
/// component cannot have).
pub fn looks_like_domain(first: &str) -> bool {
    first.contains('.') || first.contains(':') || first == "localhost" || first.chars().any(|c| c.is_ascii_uppercase())
}

/// `scope` (a host, a namespace, a repository or an image, or a
/// `*.DOMAIN` wildcard) with its host name in lower case, as references
/// keep it: how scopes and prefixes written by people are looked up.
pub fn lower_host(scope: &str) -> String {
    let host = scope.find('/').unwrap_or(scope.len());
    format!("{}{}", scope[..host].to_ascii_lowercase(), &scope[host..])
}

pub(crate) fn valid_domain(d: &str) -> bool {
    let (host, port) = if let Some(rest) = d.strip_prefix('[') {
        // [IPv6]
        let Some((inside, after)) = rest.split_once(']') else {
            return false;
        };
        if inside.is_empty() || !inside.chars().all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.') {
            return false;
        }
        match after {
            "" => return true,
            p => match p.strip_prefix(':') {
                Some(p) => return !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()),
                None => return false,
            },
        }
    } else {
        match d.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (d, None),
        }
    };
    if let Some(p) = port {
        if p.is_empty() || !p.chars().all(|c| c.is_ascii_digit()) {
            return false;
        }
    }
    !host.is_empty()
        && host.split('.').all(|c| {
            !c.is_empty()
                && c.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '-')
                && !c.starts_with('-')
                && !c.ends_with('-')
        })
}

/// `[a-z0-9]+` separated by `.`, `_`, `__` or runs of `-`.
fn valid_path_component(c: &str) -> bool {
    let b = c.as_bytes();
    if b.is_empty() || !b[0].is_ascii_lowercase() && !b[0].is_ascii_digit() {
        return false;
    }
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // A separator: ".", "_", "__" or "-"+.
        let start = i;
        match b[i] {
            b'.' => i += 1,
            b'_' => {
                i += 1;
                if i < b.len() && b[i] == b'_' {
                    i += 1;
                }
            }
            b'-' => {
                while i < b.len() && b[i] == b'-' {
                    i += 1;
                }
            }
            _ => return false,
        }
        if i == start || i >= b.len() || !alnum(b[i]) {
            return false;
        }
    }
    true
}

fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

/// `ALGORITHM:HEX`, the algorithm's components letters and digits joined by
/// `+ . - _`, at least 32 hex digits; `sha256` must have exactly 64 lower
/// case ones.
pub fn valid_digest(d: &str) -> bool {
    let Some((alg, hex)) = d.split_once(':') else {
        return false;
    };
    let alg_ok = !alg.is_empty()
        && alg.split(['+', '.', '-', '_']).all(|c| {
            let mut ch = c.chars();
            ch.next().is_some_and(|f| f.is_ascii_alphabetic()) && ch.all(|x| x.is_ascii_alphanumeric())
        });
    let hex_ok = hex.len() >= 32 && hex.chars().all(|c| c.is_ascii_hexdigit());
    let strict = match alg {
        "sha256" => hex.len() == 64 && hex.chars().all(|c| !c.is_ascii_uppercase()),
        "sha512" => hex.len() == 128 && hex.chars().all(|c| !c.is_ascii_uppercase()),
        _ => true,
    };
    alg_ok && hex_ok && strict
}

impl DockerRef {
    /// Parses and normalizes `s` (a short name gets `docker.io`, a single
    /// component there `library/`).
    pub fn parse_normalized(s: &str) -> Result<DockerRef, RefError> {
        let (name, tag, digest) = split(s)?;
        let (domain, path) = match name.split_once('/') {
            Some((first, rest)) if looks_like_domain(first) => (first.to_string(), rest.to_string()),
            _ => ("docker.io".to_string(), name.to_string()),
        };
        DockerRef::build(s, domain, path, tag, digest)
    }

    /// Parses a reference that must name its registry (no default domain).
    pub fn parse_qualified(s: &str) -> Result<DockerRef, RefError> {
        let (name, tag, digest) = split(s)?;
        match name.split_once('/') {
            Some((first, rest)) if looks_like_domain(first) => {
                DockerRef::build(s, first.to_string(), rest.to_string(), tag, digest)
            }
            _ => Err(err(s, "it does not name a registry (HOST[:PORT]/PATH)")),
        }
    }

    /// Whether `s` is a name without a registry: a short name, resolved
    /// through registries.conf's aliases and search registries.
    pub fn is_short_name(s: &str) -> bool {
        match s.split_once('/') {
            Some((first, _)) => !looks_like_domain(first),
            None => true,
        }
    }

    fn build(
        input: &str,
        mut domain: String,
        mut path: String,
        tag: Option<String>,
        digest: Option<String>,
    ) -> Result<DockerRef, RefError> {
        domain.make_ascii_lowercase();
        if domain == "index.docker.io" {
            domain = "docker.io".into();
        }
        if domain == "docker.io" && !path.contains('/') {
            path = format!("library/{path}");
        }
        if !valid_domain(&domain) {
            return Err(err(input, format!("{domain:?} is not a registry host")));
        }
        if path.chars().any(|c| c.is_ascii_uppercase()) {
            return Err(err(input, "repository names must be lower case"));
        }
        if !path.split('/').all(valid_path_component) {
            return Err(err(input, format!("{path:?} is not a repository path")));
        }
        if domain.len() + 1 + path.len() > NAME_TOTAL_MAX {
            return Err(err(
                input,
                format!("the name is longer than {NAME_TOTAL_MAX} characters"),
            ));
        }
        Ok(DockerRef {
            domain,
            path,
            tag,
            digest,
        })
    }

    /// `HOST[:PORT]/PATH`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.domain, self.path)
    }

    /// The same repository with `latest` when there is neither a tag nor a
    /// digest (as pulls and policies take a bare name).
    pub fn with_default_tag(mut self) -> DockerRef {
        if self.tag.is_none() && self.digest.is_none() {
            self.tag = Some("latest".into());
        }
        self
    }

    /// The policy identity: `NAME:TAG` or `NAME@DIGEST` (a digest wins).
    pub fn identity(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => format!("{}@{d}", self.name()),
            (None, Some(t)) => format!("{}:{t}", self.name()),
            (None, None) => self.name(),
        }
    }

    /// The scopes more general than the identity, most specific first: the
    /// repository, its parent namespaces, the host with its port, then
    /// `*.`-wildcards of the host's parent domains (without the port).
    pub fn namespaces(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut name = self.name();
        loop {
            out.push(name.clone());
            match name.rfind('/') {
                Some(i) => name.truncate(i),
                None => break,
            }
        }
        let host = match self.domain.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || p.chars().all(|c| c.is_ascii_digit()) => h,
            _ => self.domain.as_str(),
        };
        if !host.starts_with('[') {
            let mut rest = host;
            while let Some((_, parent)) = rest.split_once('.') {
                out.push(format!("*.{parent}"));
                rest = parent;
            }
        }
        out
    }

    /// A copy with `prefix` (a host, namespace or repository) replaced by
    /// `replacement`, when the name starts with it at a component boundary.
    pub fn replace_prefix(&self, prefix: &str, replacement: &str) -> Option<DockerRef> {
        let name = self.name();
        let rest = name.strip_prefix(prefix)?;
        if !rest.is_empty() && !rest.starts_with('/') {
            return None;
        }
        let new = format!("{replacement}{rest}");
        let mut r = DockerRef::parse_qualified(&new).ok()?;
        r.tag = self.tag.clone();
        r.digest = self.digest.clone();
        Some(r)
    }
}

/// NAME, TAG, DIGEST.
type Parts<'a> = (&'a str, Option<String>, Option<String>);

fn split(s: &str) -> Result<Parts<'_>, RefError> {
    if s.is_empty() {
        return Err(err(s, "empty"));
    }
    let (rest, digest) = match s.split_once('@') {
        Some((r, d)) => {
            if !valid_digest(d) {
                return Err(err(s, format!("{d:?} is not a digest")));
            }
            (r, Some(d.to_string()))
        }
        None => (s, None),
    };
    // A tag follows the last colon after the last slash (a colon before it
    // is a port).
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => {
            let t = &rest[last_slash + i + 1..];
            if !valid_tag(t) {
                return Err(err(s, format!("{t:?} is not a tag")));
            }
            (&rest[..last_slash + i], Some(t.to_string()))
        }
        None => (rest, None),
    };
    if name.is_empty() {
        return Err(err(s, "no repository name"));
    }
    Ok((name, tag, digest))
}

impl fmt::Display for DockerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name())?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn normalizes_as_docker_does() {
        let r = DockerRef::parse_normalized("busybox").unwrap();
        assert_eq!(r.name(), "docker.io/library/busybox");
        assert_eq!(
            r.clone().with_default_tag().identity(),
            "docker.io/library/busybox:latest"
        );
        let r = DockerRef::parse_normalized("index.docker.io/team/app:v1").unwrap();
        assert_eq!(r.to_string(), "docker.io/team/app:v1");
        let r = DockerRef::parse_normalized(&format!("127.0.0.1:5000/a/b@{D}")).unwrap();
        assert_eq!(r.domain, "127.0.0.1:5000");
        assert_eq!(r.identity(), format!("127.0.0.1:5000/a/b@{D}"));
        let r = DockerRef::parse_normalized("localhost/x:1").unwrap();
        assert_eq!(r.domain, "localhost");
        for bad in ["", "a//b", "a/-b", "x:", "x@sha256:12", "registry.example/Repo", "a b"] {
            assert!(DockerRef::parse_normalized(bad).is_err(), "{bad}");
        }
        assert!(DockerRef::parse_qualified("busybox").is_err());
        assert!(DockerRef::is_short_name("team/app"));
        assert!(!DockerRef::is_short_name("quay.io/app"));
    }

    #[test]
    fn namespaces_end_in_wildcards_of_the_host() {
        let r = DockerRef::parse_normalized("a.example.com:8443/ns/repo:1").unwrap();
        assert_eq!(
            r.namespaces(),
            [
                "a.example.com:8443/ns/repo",
                "a.example.com:8443/ns",
                "a.example.com:8443",
                "*.example.com",
                "*.com"
            ]
        );
        let r = DockerRef::parse_normalized("127.0.0.1:5000/x").unwrap();
        assert_eq!(r.namespaces()[..2], ["127.0.0.1:5000/x", "127.0.0.1:5000"]);
    }

    #[test]
    fn prefixes_are_replaced_at_boundaries() {
        let r = DockerRef::parse_normalized("mirror.local/vendor/app:2").unwrap();
        let s = r.replace_prefix("mirror.local/vendor", "vendor.example.com").unwrap();
        assert_eq!(s.to_string(), "vendor.example.com/app:2");
        assert!(r.replace_prefix("mirror.local/vend", "x.io").is_none());
    }
}
