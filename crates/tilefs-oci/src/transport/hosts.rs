//! containerd's registry host configuration: `DIR/HOST[:PORT]/hosts.toml`
//! (or `DIR/_default/hosts.toml` where the registry has no directory of its
//! own) lists the hosts a registry's requests go to, mirrors first, the
//! registry itself (`server`) last. Each host says what it may be asked
//! (`capabilities`: `pull` for blobs and manifests by digest, `resolve` for
//! a tag), how its TLS is checked (`skip_verify`, `ca`), which headers it
//! is sent (`header`) and whether its URL's path replaces `/v2`
//! (`override_path`). Where the directory is set
//! ([`set_config_path`]), [`Registry`](super::registry::Registry) tries the
//! hosts in order for each GET and falls back to the next when one fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

/// The configuration's largest file read.
pub const MAX_HOSTS_FILE: u64 = 1 << 20;

/// One host requests may go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// `SCHEME://HOST[:PORT]`.
    pub origin: String,
    /// Where the distribution API is under it: `/v2`, or the URL's path.
    pub api: String,
    pub pull: bool,
    pub resolve: bool,
    pub skip_verify: bool,
    /// CA certificates (PEM files) trusted besides the system's.
    pub ca: Vec<PathBuf>,
    pub headers: Vec<(String, String)>,
    /// The registry itself (`server`), not a mirror of it.
    pub upstream: bool,
}

impl Host {
    /// The URL of `rest` (`REPOSITORY/blobs/DIGEST`…) on this host; a
    /// mirror is told which registry is meant (`ns`, as containerd does).
    pub fn url(&self, rest: &str, registry: &str) -> String {
        let mut u = format!("{}{}/{rest}", self.origin, self.api);
        if !self.upstream {
            u.push_str(if u.contains('?') { "&" } else { "?" });
            u.push_str("ns=");
            u.push_str(registry);
        }
        u
    }
}

static CONFIG_PATH: RwLock<Option<PathBuf>> = RwLock::new(None);

/// Sets the directory of hosts.toml files this process's registry clients
/// honour (None: none).
pub fn set_config_path(dir: Option<PathBuf>) {
    *CONFIG_PATH.write().unwrap_or_else(|e| e.into_inner()) = dir;
}

pub fn config_path() -> Option<PathBuf> {
    CONFIG_PATH.read().unwrap_or_else(|e| e.into_inner()).clone()
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawHost {
    capabilities: Option<Vec<String>>,
    skip_verify: Option<bool>,
    ca: Option<OneOrMany>,
    header: Option<BTreeMap<String, OneOrMany>>,
    override_path: Option<bool>,
    /// Client certificates (mutual TLS): not supported, refused by name.
    client: Option<toml::Value>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    server: Option<String>,
    #[serde(flatten)]
    top: RawHost,
    /// A table keyed by URL: its order in the file is the order tried.
    host: Option<toml::Table>,
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn list(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// The hosts for `registry` (`HOST[:PORT]`) in `text` (a hosts.toml, at
/// `file` for relative `ca` paths and messages); `default_scheme` is the
/// registry's when `server` is not given (`https`, or `http` where TLS is
/// not required). Mirrors first, in the file's order, the server last.
pub fn parse(text: &str, file: &Path, registry: &str, default_scheme: &str) -> Result<Vec<Host>, String> {
    let bad = |why: String| format!("{}: {why}", file.display());
    let raw: RawFile = toml::from_str(text).map_err(|e| bad(e.message().to_string()))?;
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut hosts = Vec::new();
    if let Some(table) = raw.host {
        for (url, v) in table {
            let h: RawHost = v
                .try_into()
                .map_err(|e: toml::de::Error| bad(format!("host {url:?}: {}", e.message())))?;
            hosts.push(host(&url, h, dir, false).map_err(|e| bad(format!("host {url:?}: {e}")))?);
        }
    }
    let server = match raw.server {
        Some(s) => s,
        None if registry == "docker.io" || registry == "index.docker.io" => "https://registry-1.docker.io".into(),
        None => format!("{default_scheme}://{registry}"),
    };
    hosts.push(host(&server, raw.top, dir, true).map_err(|e| bad(format!("server {server:?}: {e}")))?);
    Ok(hosts)
}

fn host(url: &str, h: RawHost, dir: &Path, upstream: bool) -> Result<Host, String> {
    if h.client.is_some() {
        return Err("client certificates (`client`) are not supported".into());
    }
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| "not a URL (SCHEME://HOST[:PORT][/PATH])".to_string())?;
    if scheme != "http" && scheme != "https" {
        return Err(format!("scheme {scheme:?}: only http and https are"));
    }
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() || authority.contains(['@', '?', '#', ' ']) || path.contains(['?', '#', ' ']) {
        return Err("not a URL (SCHEME://HOST[:PORT][/PATH])".into());
    }
    let api = match (path, h.override_path.unwrap_or(false)) {
        ("", _) => "/v2".to_string(),
        (p, true) => p.to_string(),
        (p, false) if p.ends_with("/v2") => p.to_string(),
        (p, false) => format!("{p}/v2"),
    };
    let caps = h
        .capabilities
        .unwrap_or_else(|| vec!["pull".into(), "resolve".into(), "push".into()]);
    for c in &caps {
        if !matches!(c.as_str(), "pull" | "resolve" | "push") {
            return Err(format!("capability {c:?}: pull, resolve and push are"));
        }
    }
    let mut headers = Vec::new();
    for (name, values) in h.header.unwrap_or_default() {
        if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(format!("header {name:?}: not a header name"));
        }
        for v in values.list() {
            if reqwest::header::HeaderValue::from_str(&v).is_err() {
                return Err(format!("header {name:?}: not a header value"));
            }
            headers.push((name.clone(), v));
        }
    }
    Ok(Host {
        origin: format!("{scheme}://{authority}"),
        api,
        pull: caps.iter().any(|c| c == "pull"),
        resolve: caps.iter().any(|c| c == "resolve"),
        skip_verify: h.skip_verify.unwrap_or(false),
        ca: h
            .ca
            .map(OneOrMany::list)
            .unwrap_or_default()
            .into_iter()
            .map(|p| dir.join(p))
            .collect(),
        headers,
        upstream,
    })
}

/// The hosts configured for `registry` under the directory set with
/// [`set_config_path`]: None where none is set, or neither the registry's
/// directory nor `_default` has a hosts.toml.
pub fn for_registry(registry: &str, default_scheme: &str) -> Result<Option<Vec<Host>>, String> {
    let Some(dir) = config_path() else {
        return Ok(None);
    };
    // A host name is a path component here: nothing that climbs out.
    if registry.is_empty() || registry.contains(['/', '\0']) || registry.starts_with('.') {
        return Ok(None);
    }
    for d in [registry, "_default"] {
        let file = dir.join(d).join("hosts.toml");
        // Not blocking on a FIFO put where the file should be.
        let mut f = match tilefs_store::open_regular(rustix::fs::CWD, &file, true) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: cannot read: {e}", file.display())),
        };
        let text =
            crate::bounded::read_at_most(&mut f, MAX_HOSTS_FILE).map_err(|e| format!("{}: {e}", file.display()))?;
        let text = String::from_utf8(text).map_err(|_| format!("{}: not UTF-8", file.display()))?;
        return parse(&text, &file, registry, default_scheme).map(Some);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<Vec<Host>, String> {
        parse(text, Path::new("/etc/hosts.d/r:5000/hosts.toml"), "r:5000", "https")
    }

    #[test]
    fn mirrors_in_order_then_the_server() {
        let h = p(r#"
server = "https://r:5000"
[host."http://m2:6000"]
  capabilities = ["pull"]
[host."https://m1/cache"]
  capabilities = ["pull", "resolve"]
  skip_verify = true
  ca = "ca.pem"
  [host."https://m1/cache".header]
    x-a = ["1", "2"]
[host."https://m3/raw"]
  override_path = true
"#)
        .unwrap();
        assert_eq!(h.len(), 4);
        assert_eq!(h[0].origin, "http://m2:6000");
        assert!(h[0].pull && !h[0].resolve);
        assert_eq!(
            h[0].url("app/blobs/sha256:aa", "r:5000"),
            "http://m2:6000/v2/app/blobs/sha256:aa?ns=r:5000"
        );
        assert_eq!(h[1].api, "/cache/v2");
        assert!(h[1].skip_verify);
        assert_eq!(h[1].ca, vec![PathBuf::from("/etc/hosts.d/r:5000/ca.pem")]);
        assert_eq!(h[1].headers.len(), 2);
        assert_eq!(h[2].api, "/raw");
        assert!(h[3].upstream && h[3].pull && h[3].resolve);
        assert_eq!(
            h[3].url("app/manifests/v1", "r:5000"),
            "https://r:5000/v2/app/manifests/v1"
        );
    }

    #[test]
    fn without_server_the_registry_itself() {
        let h = parse("", Path::new("x/hosts.toml"), "r:5000", "http").unwrap();
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].origin, "http://r:5000");
    }

    #[test]
    fn bad_files_say_why() {
        assert!(p("server = 3").unwrap_err().contains("hosts.toml"));
        assert!(p(r#"[host."ftp://m"]"#).unwrap_err().contains("scheme"));
        assert!(p(r#"[host."http://m"]
capabilities = ["fly"]"#)
        .unwrap_err()
        .contains("capability"));
        assert!(p(r#"[host."http://m".client]
x = 1"#)
        .unwrap_err()
        .contains("client"));
        assert!(p("bogus = 1").unwrap_err().contains("bogus"));
    }
}
