//! Where images come from, containers-registries.conf(5) version 2 (and
//! the version 1 tables it replaced): `[[registry]]` tables chosen by the
//! longest matching `prefix`, each with its `location`, `insecure`,
//! `blocked` and `[[registry.mirror]]`s; `unqualified-search-registries`,
//! `[aliases]` and `short-name-mode` for names without a registry.
//! Drop-ins (`registries.conf.d/*.conf`) are applied in order over the
//! main file, containers-registries.conf.d(5).

use crate::dockerref::{looks_like_domain, DockerRef};
use crate::{Error, Refused};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum PullFromMirror {
    #[default]
    All,
    DigestOnly,
    TagOnly,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Mirror {
    pub location: String,
    #[serde(default)]
    pub insecure: bool,
    #[serde(default, deserialize_with = "pull_from_mirror")]
    pub pull_from_mirror: PullFromMirror,
}

fn pull_from_mirror<'de, D: serde::Deserializer<'de>>(d: D) -> Result<PullFromMirror, D::Error> {
    let s = String::deserialize(d)?;
    match s.as_str() {
        "" | "all" => Ok(PullFromMirror::All),
        "digest-only" => Ok(PullFromMirror::DigestOnly),
        "tag-only" => Ok(PullFromMirror::TagOnly),
        o => Err(serde::de::Error::custom(format!(
            "pull-from-mirror {o:?} is not all, digest-only or tag-only"
        ))),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Registry {
    #[serde(default)]
    pub prefix: String,
    #[serde(default)]
    pub location: String,
    #[serde(default)]
    pub insecure: bool,
    #[serde(default)]
    pub blocked: bool,
    #[serde(default)]
    pub mirror_by_digest_only: bool,
    #[serde(default)]
    pub mirror: Vec<Mirror>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShortNameMode {
    Enforcing,
    Permissive,
    Disabled,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct V1List {
    #[serde(default)]
    registries: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct V1 {
    #[serde(default)]
    search: V1List,
    #[serde(default)]
    insecure: V1List,
    #[serde(default)]
    block: V1List,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct File {
    unqualified_search_registries: Option<Vec<String>>,
    short_name_mode: Option<String>,
    #[serde(default)]
    credential_helpers: Option<Vec<String>>,
    aliases: Option<BTreeMap<String, String>>,
    registry: Option<Vec<Registry>>,
    registries: Option<V1>,
}

/// The merged configuration.
#[derive(Debug, Clone, Default)]
pub struct RegistriesConf {
    /// The files read, in order, for messages.
    pub files: Vec<PathBuf>,
    pub search: Vec<String>,
    pub short_name_mode: Option<ShortNameMode>,
    /// Short name -> fully qualified repository, and the file that said so.
    pub aliases: BTreeMap<String, (String, PathBuf)>,
    pub registries: Vec<Registry>,
}

/// One place to pull an image from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The reference at that place (a mirror's or the registry's location).
    pub reference: DockerRef,
    pub insecure: bool,
    pub mirror: bool,
}

/// A reference's `[[registry]]` table and where to pull it from.
#[derive(Debug, Clone)]
pub struct Route {
    /// The table's prefix (None: no table matched).
    pub prefix: Option<String>,
    pub endpoints: Vec<Endpoint>,
}

fn valid_location(loc: &str) -> bool {
    if loc.contains('/') {
        DockerRef::parse_qualified(loc).is_ok()
    } else {
        crate::dockerref::valid_domain(loc)
    }
}

/// Whether `name` (a fully expanded reference) is under `prefix`. Host
/// names are compared as DNS compares them, without regard to case
/// (`Blocked.IO/x` is under `blocked.io`); the rest of the name exactly.
fn prefix_matches(name: &str, prefix: &str) -> bool {
    if let Some(domain) = prefix.strip_prefix("*.") {
        let host = name.split('/').next().unwrap_or("");
        let host = host.split(':').next().unwrap_or(host).to_ascii_lowercase();
        return host.ends_with(&format!(".{}", domain.to_ascii_lowercase()));
    }
    match strip_prefix(name, prefix) {
        Some("") => true,
        Some(rest) => rest.starts_with(['/', ':', '@']),
        None => false,
    }
}

/// `name` without `prefix` at its start, the host names (up to the first
/// `/`) compared without regard to case.
fn strip_prefix<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    let head = name.get(..prefix.len())?;
    let host = prefix.find('/').unwrap_or(prefix.len());
    let same = head[..host].eq_ignore_ascii_case(&prefix[..host]) && head[host..] == prefix[host..];
    same.then(|| &name[prefix.len()..])
}

/// A prefix as tables are told apart: its host name in lower case.
fn prefix_key(prefix: &str) -> String {
    crate::dockerref::lower_host(prefix)
}

impl RegistriesConf {
    /// Applies the text of one file (named `path` in messages) over `self`.
    pub fn add(&mut self, raw: &[u8], path: &Path) -> Result<(), Error> {
        let name = path.display().to_string();
        let text = std::str::from_utf8(raw).map_err(|_| Error::invalid(&name, "not UTF-8"))?;
        let f: File = toml::from_str(text).map_err(|e| Error::invalid(&name, e.to_string().trim().to_string()))?;
        let v2 = f.unqualified_search_registries.is_some()
            || f.short_name_mode.is_some()
            || f.aliases.is_some()
            || f.registry.is_some();
        let mut regs = f.registry.unwrap_or_default();
        let mut search = f.unqualified_search_registries;
        if let Some(v1) = f.registries {
            if v2 {
                return Err(Error::invalid(
                    &name,
                    "mixes the version 1 [registries.*] tables with version 2 settings".to_string(),
                ));
            }
            search = Some(v1.search.registries);
            let mut by_loc: BTreeMap<String, Registry> = BTreeMap::new();
            for (list, insecure) in [(&v1.insecure.registries, true), (&v1.block.registries, false)] {
                for loc in list {
                    let r = by_loc.entry(prefix_key(loc)).or_insert_with(|| Registry {
                        prefix: loc.clone(),
                        location: loc.clone(),
                        insecure: false,
                        blocked: false,
                        mirror_by_digest_only: false,
                        mirror: Vec::new(),
                    });
                    if insecure {
                        r.insecure = true;
                    } else {
                        r.blocked = true;
                    }
                }
            }
            regs = by_loc.into_values().collect();
        }
        if let Some(s) = search {
            for r in &s {
                if r.contains('/') || !valid_location(r) {
                    return Err(Error::invalid(
                        &name,
                        format!("unqualified-search-registries entry {r:?} is not a host[:port]"),
                    ));
                }
            }
            self.search = s;
        }
        if let Some(m) = f.short_name_mode {
            self.short_name_mode = match m.as_str() {
                "enforcing" => Some(ShortNameMode::Enforcing),
                "permissive" => Some(ShortNameMode::Permissive),
                "disabled" => Some(ShortNameMode::Disabled),
                "" => None,
                o => {
                    return Err(Error::invalid(
                        &name,
                        format!("short-name-mode {o:?} is not enforcing, permissive or disabled"),
                    ))
                }
            };
        }
        let _ = f.credential_helpers;
        for (k, v) in f.aliases.unwrap_or_default() {
            if v.is_empty() {
                self.aliases.remove(&k);
                continue;
            }
            check_alias(&k, &v).map_err(|e| Error::invalid(&name, format!("alias {k:?}: {e}")))?;
            self.aliases.insert(k, (v, path.to_path_buf()));
        }
        let mut seen = std::collections::HashSet::new();
        for mut r in regs {
            if r.prefix.is_empty() {
                r.prefix = r.location.clone();
            }
            if r.prefix.is_empty() {
                return Err(Error::invalid(&name, "a [[registry]] has neither prefix nor location"));
            }
            if !seen.insert(prefix_key(&r.prefix)) {
                return Err(Error::invalid(
                    &name,
                    format!("two [[registry]] tables have the prefix {:?}", r.prefix),
                ));
            }
            let wildcard = r.prefix.starts_with("*.");
            if wildcard {
                let d = &r.prefix[2..];
                if d.is_empty() || d.contains(['*', '/', ':']) || !valid_location(d) {
                    return Err(Error::invalid(
                        &name,
                        format!("prefix {:?}: a wildcard prefix is *.DOMAIN, nothing more", r.prefix),
                    ));
                }
            } else if !valid_location(&r.prefix) {
                return Err(Error::invalid(
                    &name,
                    format!("prefix {:?} is not a registry, namespace or repository", r.prefix),
                ));
            }
            if !r.location.is_empty() && (r.location.starts_with("*.") || !valid_location(&r.location)) {
                return Err(Error::invalid(
                    &name,
                    format!("location {:?} is not a registry, namespace or repository", r.location),
                ));
            }
            if wildcard && !r.location.is_empty() {
                return Err(Error::invalid(
                    &name,
                    format!("prefix {:?}: a wildcard prefix takes no location", r.prefix),
                ));
            }
            for m in &r.mirror {
                if m.location.starts_with("*.") || !valid_location(&m.location) {
                    return Err(Error::invalid(
                        &name,
                        format!(
                            "mirror location {:?} is not a registry, namespace or repository",
                            m.location
                        ),
                    ));
                }
                if r.mirror_by_digest_only && m.pull_from_mirror != PullFromMirror::All {
                    return Err(Error::invalid(
                        &name,
                        format!(
                            "prefix {:?}: pull-from-mirror cannot be set with mirror-by-digest-only",
                            r.prefix
                        ),
                    ));
                }
            }
            // A drop-in's table replaces one of the same prefix.
            match self
                .registries
                .iter_mut()
                .find(|x| prefix_key(&x.prefix) == prefix_key(&r.prefix))
            {
                Some(x) => *x = r,
                None => self.registries.push(r),
            }
        }
        self.files.push(path.to_path_buf());
        Ok(())
    }

    /// Reads `main` (if it exists) and then each `*.conf` of `dropins`, in
    /// order, each directory's files in name order.
    pub fn load(main: Option<&Path>, dropins: &[PathBuf]) -> Result<RegistriesConf, Error> {
        let mut c = RegistriesConf::default();
        if let Some(m) = main {
            match crate::read_config(m) {
                Ok(raw) => c.add(&raw, m)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::read(m, e)),
            }
        }
        for d in dropins {
            let Ok(rd) = std::fs::read_dir(d) else { continue };
            let mut files: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file() || t.is_symlink()))
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "conf"))
                .collect();
            files.sort();
            for f in files {
                let raw = crate::read_config(&f).map_err(|e| Error::read(&f, e))?;
                c.add(&raw, &f)?;
            }
        }
        Ok(c)
    }

    /// Adds the aliases of the machine-written short-name-aliases.conf,
    /// which take precedence over those of the configuration.
    pub fn add_alias_cache(&mut self, path: &Path) -> Result<(), Error> {
        let raw = match crate::read_config(path) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::read(path, e)),
        };
        #[derive(Deserialize)]
        struct Cache {
            #[serde(default)]
            aliases: BTreeMap<String, String>,
        }
        let text = std::str::from_utf8(&raw).map_err(|_| Error::read(path, "not UTF-8"))?;
        let c: Cache = toml::from_str(text).map_err(|e| Error::read(path, e))?;
        for (k, v) in c.aliases {
            if !v.is_empty() && check_alias(&k, &v).is_ok() {
                self.aliases.insert(k, (v, path.to_path_buf()));
            }
        }
        Ok(())
    }

    /// The table whose prefix is the longest match of `r`.
    pub fn registry_for(&self, r: &DockerRef) -> Option<&Registry> {
        let name = r.to_string();
        self.registries
            .iter()
            .filter(|x| prefix_matches(&name, &x.prefix))
            .max_by_key(|x| x.prefix.len())
    }

    /// Where to pull `r` from: its mirrors that apply, in order, then the
    /// registry's location; or why it may not be pulled.
    pub fn route(&self, r: &DockerRef) -> Result<Route, Refused> {
        let Some(reg) = self.registry_for(r) else {
            return Ok(Route {
                prefix: None,
                endpoints: vec![Endpoint {
                    reference: r.clone(),
                    insecure: false,
                    mirror: false,
                }],
            });
        };
        if reg.blocked {
            return Err(Refused::Blocked {
                image: format!("docker://{r}"),
                domain: r.domain.clone(),
                prefix: reg.prefix.clone(),
                files: self.files_display(),
            });
        }
        let rewrite = |loc: &str| -> Result<DockerRef, Refused> {
            if reg.prefix.starts_with("*.") || loc.is_empty() {
                return Ok(r.clone());
            }
            let name = r.to_string();
            let rest = strip_prefix(&name, &reg.prefix).unwrap_or("");
            let mut out = DockerRef::parse_qualified(&format!("{loc}{rest}")).map_err(|e| Refused::Unusable {
                image: format!("docker://{r}"),
                error: Error::invalid(format!("prefix {:?} rewritten to {loc:?}", reg.prefix), e.to_string()),
            })?;
            if out.tag.is_none() && out.digest.is_none() {
                out.tag = r.tag.clone();
                out.digest = r.digest.clone();
            }
            Ok(out)
        };
        let by_digest = r.digest.is_some();
        let mut endpoints = Vec::new();
        for m in &reg.mirror {
            let wanted = if reg.mirror_by_digest_only {
                by_digest
            } else {
                match m.pull_from_mirror {
                    PullFromMirror::All => true,
                    PullFromMirror::DigestOnly => by_digest,
                    PullFromMirror::TagOnly => !by_digest,
                }
            };
            if wanted {
                endpoints.push(Endpoint {
                    reference: rewrite(&m.location)?,
                    insecure: m.insecure,
                    mirror: true,
                });
            }
        }
        endpoints.push(Endpoint {
            reference: rewrite(&reg.location)?,
            insecure: reg.insecure,
            mirror: false,
        });
        Ok(Route {
            prefix: Some(reg.prefix.clone()),
            endpoints,
        })
    }

    /// The files read, for messages.
    pub fn files_display(&self) -> String {
        if self.files.is_empty() {
            "no registries.conf".into()
        } else {
            self.files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    }

    /// The fully qualified references a name stands for, to try in order:
    /// itself when it names a registry; a short name's alias; else its
    /// search registries, as `short-name-mode` allows (without a terminal,
    /// `enforcing` refuses a name that more than one registry could serve).
    pub fn resolve(&self, name: &str) -> Result<Resolution, Error> {
        if !DockerRef::is_short_name(name) {
            let r = DockerRef::parse_qualified(name)?;
            return Ok(Resolution {
                candidates: vec![r.with_default_tag()],
                how: "fully qualified".into(),
            });
        }
        // Validate the short name itself.
        let parsed = DockerRef::parse_normalized(name)?;
        let (bare, tag, digest) = (name_only(name), parsed.tag.clone(), parsed.digest.clone());
        let with = |mut r: DockerRef| {
            if tag.is_some() || digest.is_some() {
                r.tag = tag.clone();
                r.digest = digest.clone();
            }
            r.with_default_tag()
        };
        if let Some((target, file)) = self.aliases.get(bare) {
            let r = DockerRef::parse_qualified(target)
                .map_err(|e| Error::invalid(format!("alias {bare:?}"), e.to_string()))?;
            return Ok(Resolution {
                candidates: vec![with(r)],
                how: format!("alias {bare:?} = {target:?} in {}", file.display()),
            });
        }
        let mode = self.short_name_mode.unwrap_or(ShortNameMode::Permissive);
        if self.search.is_empty() {
            return Err(Error::ShortName(format!(
                "{name:?} is a short name and no unqualified-search-registries are configured ({}): \
                 use a fully qualified name (HOST/REPO) or an alias",
                self.files_display()
            )));
        }
        if mode == ShortNameMode::Enforcing && self.search.len() > 1 {
            return Err(Error::ShortName(format!(
                "short name {name:?} is ambiguous: short-name-mode is enforcing and it could come from any of \
                 {} ({}), and there is no terminal to ask; use a fully qualified name or define an alias",
                self.search.join(", "),
                self.files_display()
            )));
        }
        let mut candidates = Vec::new();
        for host in &self.search {
            let r = DockerRef::parse_normalized(&format!("{host}/{bare}"))?;
            candidates.push(with(r));
        }
        Ok(Resolution {
            how: format!("the unqualified-search-registries {}", self.search.join(", ")),
            candidates,
        })
    }
}

/// A short name's candidates.
#[derive(Debug, Clone)]
pub struct Resolution {
    pub candidates: Vec<DockerRef>,
    /// How they were found, for messages.
    pub how: String,
}

fn name_only(s: &str) -> &str {
    let s = s.split('@').next().unwrap_or(s);
    let last = s.rfind('/').map_or(0, |i| i + 1);
    match s[last..].rfind(':') {
        Some(i) => &s[..last + i],
        None => s,
    }
}

fn check_alias(k: &str, v: &str) -> Result<(), Error> {
    if !DockerRef::is_short_name(k) || k.contains([':', '@']) {
        return Err(Error::ShortName(
            "the name must be a short name without tag or digest".into(),
        ));
    }
    DockerRef::parse_normalized(k)?;
    let first = v.split('/').next().unwrap_or("");
    if !looks_like_domain(first) || !v.contains('/') {
        return Err(Error::ShortName(format!("{v:?} is not a fully qualified repository")));
    }
    let r = DockerRef::parse_qualified(v)?;
    if r.tag.is_some() || r.digest.is_some() {
        return Err(Error::ShortName(format!("{v:?} has a tag or digest")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(files: &[&str]) -> RegistriesConf {
        let mut c = RegistriesConf::default();
        for (i, f) in files.iter().enumerate() {
            c.add(f.as_bytes(), Path::new(&format!("f{i}.conf"))).unwrap();
        }
        c
    }

    fn r(s: &str) -> DockerRef {
        DockerRef::parse_normalized(s).unwrap()
    }

    #[test]
    fn mirrors_then_the_registry() {
        let c = conf(&[r#"
            [[registry]]
            prefix = "example.com/foo"
            location = "internal.example.net/bar"
            [[registry.mirror]]
            location = "mirror0.local/mirror-for-foo"
            [[registry.mirror]]
            location = "mirror1.local/mirrors/foo"
            insecure = true
            pull-from-mirror = "digest-only"
            [[registry]]
            location = "blocked.io"
            blocked = true
        "#]);
        let route = c.route(&r("example.com/foo/image:latest")).unwrap();
        let eps: Vec<String> = route.endpoints.iter().map(|e| e.reference.to_string()).collect();
        assert_eq!(
            eps,
            [
                "mirror0.local/mirror-for-foo/image:latest",
                "internal.example.net/bar/image:latest"
            ]
        );
        let d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let route = c.route(&r(&format!("example.com/foo/image@{d}"))).unwrap();
        assert_eq!(route.endpoints.len(), 3);
        assert!(route.endpoints[1].insecure && route.endpoints[1].mirror);
        assert!(c.route(&r("blocked.io/x")).unwrap_err().to_string().contains("blocked"));
        assert_eq!(c.route(&r("example.com/foobar:1")).unwrap().prefix, None);
    }

    #[test]
    fn dropins_override_and_short_names() {
        let c = conf(&[
            r#"unqualified-search-registries = ["a.io", "b.io"]
               [aliases]
               "app" = "a.io/team/app"
               "gone" = "a.io/gone"
               [[registry]]
               location = "a.io"
               insecure = true"#,
            r#"short-name-mode = "enforcing"
               [aliases]
               "gone" = ""
               [[registry]]
               location = "a.io"
               insecure = false"#,
        ]);
        assert_eq!(c.registries.len(), 1);
        assert!(!c.registries[0].insecure);
        let res = c.resolve("app:2").unwrap();
        assert_eq!(res.candidates[0].to_string(), "a.io/team/app:2");
        assert!(c.resolve("gone").unwrap_err().to_string().contains("ambiguous"));
        let one = conf(&[r#"unqualified-search-registries = ["a.io"]
            short-name-mode = "enforcing""#]);
        assert_eq!(one.resolve("x").unwrap().candidates[0].to_string(), "a.io/x:latest");
        let perm = conf(&[r#"unqualified-search-registries = ["a.io", "docker.io"]"#]);
        let c2: Vec<String> = perm
            .resolve("x")
            .unwrap()
            .candidates
            .iter()
            .map(|c| c.to_string())
            .collect();
        assert_eq!(c2, ["a.io/x:latest", "docker.io/library/x:latest"]);
        assert_eq!(
            perm.resolve("q.io/x@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
                .unwrap()
                .candidates[0]
                .tag,
            None
        );
    }

    #[test]
    fn v1_and_bad_files() {
        let c = conf(&[r#"[registries.search]
            registries = ["a.io"]
            [registries.block]
            registries = ["bad.io"]"#]);
        assert_eq!(c.search, ["a.io"]);
        assert!(c.route(&r("bad.io/x")).is_err());
        for bad in [
            "unknown = 1",
            "[[registry]]\nprefix = \"*.x.io/foo\"",
            "[[registry]]\nlocation = \"Not A Host\"",
            "short-name-mode = \"loose\"",
            "[aliases]\n\"a.io/x\" = \"b.io/x\"",
            "[[registry]]\nlocation=\"a.io\"\nmirror-by-digest-only=true\n[[registry.mirror]]\nlocation=\"m.io\"\npull-from-mirror=\"tag-only\"",
            "unqualified-search-registries = [\"a.io\"]\n[registries.search]\nregistries=[]",
            "[[registry]]\nlocation=\"a.io\"\n[[registry]]\nlocation=\"a.io\"",
        ] {
            let mut c = RegistriesConf::default();
            assert!(c.add(bad.as_bytes(), Path::new("x")).is_err(), "{bad}");
        }
    }

    #[test]
    fn host_names_match_without_regard_to_case() {
        let c = conf(&[r#"
            [[registry]]
            location = "blocked.io"
            blocked = true
            [[registry]]
            prefix = "Example.COM/team"
            location = "mirror.local/team"
            [[registry]]
            prefix = "*.Corp.example"
            insecure = true
        "#]);
        for name in [
            "Blocked.IO/x",
            "BLOCKED.io/a/b:1",
            "blocked.IO/x@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            assert!(
                c.route(&r(name)).unwrap_err().to_string().contains("is blocked"),
                "{name}"
            );
        }
        let route = c.route(&r("EXAMPLE.com/team/app:1")).unwrap();
        assert_eq!(route.endpoints[0].reference.to_string(), "mirror.local/team/app:1");
        // The path is not a host name: repository names are lower case.
        assert!(c.route(&r("example.com/teams/app")).unwrap().prefix.is_none());
        assert!(c.route(&r("A.CORP.example/x")).unwrap().endpoints[0].insecure);
        // Tables whose prefixes differ only in the case of their host are
        // one table: two in one file are refused, a drop-in replaces.
        let mut dup = RegistriesConf::default();
        let two = "[[registry]]\nlocation=\"a.io\"\n[[registry]]\nlocation=\"A.io\"";
        assert!(dup.add(two.as_bytes(), Path::new("x")).is_err());
        let c = conf(&[
            "[[registry]]\nlocation = \"a.io\"\nblocked = true",
            "[[registry]]\nlocation = \"A.IO\"\ninsecure = true",
        ]);
        assert_eq!(c.registries.len(), 1);
        assert!(c.route(&r("a.io/x")).unwrap().endpoints[0].insecure);
        // Version 1 lists too.
        let v1 =
            conf(&["[registries.insecure]\nregistries = [\"bad.io\"]\n[registries.block]\nregistries = [\"Bad.io\"]"]);
        assert!(v1.route(&r("BAD.IO/x")).unwrap_err().to_string().contains("is blocked"));
    }

    #[test]
    fn wildcards_match_subdomains() {
        let c = conf(&["[[registry]]\nprefix = \"*.example.com\"\ninsecure = true"]);
        let route = c.route(&r("a.b.example.com:5000/x:1")).unwrap();
        assert!(route.endpoints[0].insecure);
        assert_eq!(route.endpoints[0].reference.to_string(), "a.b.example.com:5000/x:1");
        assert!(c.route(&r("example.com/x")).unwrap().prefix.is_none());
    }
}
