//! Mount options as `mount -o` (fstab, `mount.tilefs`) and `tilefs mount -o`
//! give them: `store=DIR,upper=DIR,work=DIR,verity=MODE,digest=HEX,ro,...`.

use crate::{Atime, MountAttrs, Verity};
use std::path::PathBuf;

/// Which implementation serves the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Kernel,
    Fuse,
    /// A kernel mount made by the mount service (`tilefs mountd`).
    Delegated,
}

/// What an option string asks for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ParsedOptions {
    pub stores: Vec<PathBuf>,
    pub upper: Option<PathBuf>,
    pub work: Option<PathBuf>,
    pub verity: Option<Verity>,
    pub digest: Option<[u8; 32]>,
    /// `ro` (Some(true)) or `rw` (Some(false)), the last one given.
    pub read_only: Option<bool>,
    pub attrs: MountAttrs,
    pub backend: Option<Backend>,
    /// FUSE: `nopassthrough` (false) serves every read from the server
    /// even where the kernel could read the object itself; `passthrough`
    /// (true) lets the kernel read and write upper files of a writable
    /// mount itself (unset: read-only mounts do, writable ones do not).
    pub passthrough: Option<bool>,
    /// FUSE: `nouring` (false) reads /dev/fuse even where the kernel
    /// offers FUSE over io_uring.
    pub uring: Option<bool>,
    /// FUSE: `idlepoll` (true) or `noidlepoll` (false): idle CPUs poll,
    /// not halt, while requests flow (root only); unset: where it pays.
    pub idle_poll: Option<bool>,
    /// FUSE writable mounts: `uidmapping=STORED:SHOWN:LEN[:...]` (and
    /// `gidmapping`): ids as stored in the image and the upper directory,
    /// shown to the kernel as other ids.
    pub uid_map: Option<String>,
    pub gid_map: Option<String>,
    /// FUSE: `allow_other`, other users may use the mount (kernel mounts
    /// always let them).
    pub allow_other: bool,
    /// `suid` / `dev` given explicitly (the last word of each pair): a
    /// mount that cannot honour them must refuse, not ignore them.
    pub suid_asked: bool,
    pub dev_asked: bool,
    /// Anything else: handed to overlayfs as is (the kernel judges it).
    pub overlay: Vec<(String, Option<String>)>,
    /// Options for mount(8) itself or meaningless here, accepted and ignored.
    pub ignored: Vec<String>,
}

/// Options mount(8) and fstab use that say nothing to tilefs.
const IGNORED: &[&str] = &[
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "owner",
    "group",
    "_netdev",
    "nofail",
    "sync",
    "async",
    "dirsync",
    "loud",
    "silent",
    "lazytime",
    "nolazytime",
    "iversion",
    "noiversion",
    "mand",
    "nomand",
];

/// Options overlayfs gets from tilefs itself, never from the user.
const RESERVED_OVERLAY: &[&str] = &[
    "lowerdir",
    "lowerdir+",
    "datadir+",
    "upperdir",
    "workdir",
    "metacopy",
    "redirect_dir",
    "verity",
    "source",
];

/// Splits `a=b,c,"d=e,f"` at commas outside double quotes.
pub fn split(opts: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in opts.chars() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out.into_iter().filter(|s| !s.is_empty()).collect()
}

/// Parses a digest: 64 hex digits, optionally after `sha256:`.
pub fn parse_digest(s: &str) -> Result<[u8; 32], String> {
    let h = s.strip_prefix("sha256:").unwrap_or(s);
    let mut d = [0u8; 32];
    if h.len() != 64 {
        return Err(format!(
            "digest {s:?}: expected 64 hex digits (an fs-verity SHA-256 digest), got {}",
            h.len()
        ));
    }
    hex::decode_to_slice(h, &mut d).map_err(|e| format!("digest {s:?}: {e}"))?;
    Ok(d)
}

/// Parses one `-o` string (several may be given; call [`ParsedOptions::add`]).
pub fn parse(opts: &str) -> Result<ParsedOptions, String> {
    let mut p = ParsedOptions::default();
    p.add(opts)?;
    Ok(p)
}

impl ParsedOptions {
    /// Adds the options of one `-o` string.
    pub fn add(&mut self, opts: &str) -> Result<(), String> {
        for opt in split(opts) {
            let (key, value) = match opt.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (opt.clone(), None),
            };
            let need = |v: &Option<String>| -> Result<String, String> {
                match v {
                    Some(v) if !v.is_empty() => Ok(v.clone()),
                    _ => Err(format!("option {key} needs a value ({key}=...)")),
                }
            };
            match key.as_str() {
                "store" => self.stores.push(PathBuf::from(need(&value)?)),
                // composefs's name: several stores separated by colons.
                "basedir" => self
                    .stores
                    .extend(need(&value)?.split(':').filter(|s| !s.is_empty()).map(PathBuf::from)),
                "upper" | "upperdir" => self.upper = Some(PathBuf::from(need(&value)?)),
                "work" | "workdir" => self.work = Some(PathBuf::from(need(&value)?)),
                "verity" => {
                    self.verity = Some(match &value {
                        // composefs: a bare `verity` requires it.
                        None => Verity::Require,
                        Some(v) => v.parse()?,
                    })
                }
                "tryverity" => self.verity = Some(Verity::Auto),
                "noverity" => self.verity = Some(Verity::Off),
                "digest" => self.digest = Some(parse_digest(&need(&value)?)?),
                "ro" => self.read_only = Some(true),
                "rw" => self.read_only = Some(false),
                "kernel" => self.backend = Some(Backend::Kernel),
                "fuse" => self.backend = Some(Backend::Fuse),
                "delegated" => self.backend = Some(Backend::Delegated),
                "passthrough" => self.passthrough = Some(true),
                "nopassthrough" => self.passthrough = Some(false),
                "uring" => self.uring = Some(true),
                "nouring" => self.uring = Some(false),
                "idlepoll" => self.idle_poll = Some(true),
                "noidlepoll" => self.idle_poll = Some(false),
                "uidmapping" => self.uid_map = Some(need(&value)?),
                "gidmapping" => self.gid_map = Some(need(&value)?),
                "nosuid" | "suid" => {
                    self.attrs.nosuid = key == "nosuid";
                    self.suid_asked = key == "suid";
                }
                "nodev" | "dev" => {
                    self.attrs.nodev = key == "nodev";
                    self.dev_asked = key == "dev";
                }
                "allow_other" => self.allow_other = true,
                "noexec" => self.attrs.noexec = true,
                "exec" => self.attrs.noexec = false,
                "nosymfollow" => self.attrs.nosymfollow = true,
                "symfollow" => self.attrs.nosymfollow = false,
                "noatime" => self.attrs.atime = Some(Atime::NoAtime),
                "relatime" => self.attrs.atime = Some(Atime::Relatime),
                "strictatime" => self.attrs.atime = Some(Atime::Strict),
                "atime" | "norelatime" => self.attrs.atime = Some(Atime::Strict),
                "nodiratime" => self.attrs.nodiratime = true,
                "diratime" => self.attrs.nodiratime = false,
                "idmap" => return Err("option idmap is not supported by tilefs".into()),
                "remount" | "bind" | "rbind" | "move" => {
                    return Err(format!("option {key} is not supported by tilefs mounts"))
                }
                k if IGNORED.contains(&k)
                    || k.starts_with("x-")
                    || k.starts_with("X-")
                    || k == "comment"
                    || k.ends_with("context") =>
                {
                    self.ignored.push(opt.clone())
                }
                k if RESERVED_OVERLAY.contains(&k) => {
                    return Err(format!("option {k} is set by tilefs itself and cannot be given"))
                }
                _ => self.overlay.push((key, value)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fstab_style() {
        let p =
            parse("store=/s,ro,noauto,x-systemd.automount,upper=/u,workdir=/w,verity=off,nosuid,index=off").unwrap();
        assert_eq!(p.stores, vec![PathBuf::from("/s")]);
        assert_eq!(p.upper, Some(PathBuf::from("/u")));
        assert_eq!(p.work, Some(PathBuf::from("/w")));
        assert_eq!(p.verity, Some(Verity::Off));
        assert_eq!(p.read_only, Some(true));
        assert!(p.attrs.nosuid);
        assert_eq!(p.ignored, vec!["noauto", "x-systemd.automount"]);
        assert_eq!(p.overlay, vec![("index".to_string(), Some("off".to_string()))]);
    }

    #[test]
    fn composefs_names() {
        let p = parse("basedir=/a:/b,verity").unwrap();
        assert_eq!(p.stores, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(p.verity, Some(Verity::Require));
        assert_eq!(parse("tryverity").unwrap().verity, Some(Verity::Auto));
    }

    #[test]
    fn fuse_choices() {
        let p = parse("fuse,nopassthrough").unwrap();
        assert_eq!(p.backend, Some(Backend::Fuse));
        assert_eq!(p.passthrough, Some(false));
        assert!(p.overlay.is_empty());
        assert_eq!(parse("nopassthrough,passthrough").unwrap().passthrough, Some(true));
        let p = parse("allow_other,suid,nodev,dev,nosuid").unwrap();
        assert!(p.allow_other && p.overlay.is_empty());
        assert!(p.attrs.nosuid && !p.suid_asked);
        assert!(!p.attrs.nodev && p.dev_asked);
    }

    #[test]
    fn quotes_and_errors() {
        let p = parse("store=\"/with,comma\"").unwrap();
        assert_eq!(p.stores, vec![PathBuf::from("/with,comma")]);
        assert!(parse("store").is_err());
        assert!(parse("verity=maybe").is_err());
        assert!(parse("lowerdir=/x").is_err());
        assert!(parse("digest=abc").is_err());
        let d = "ab".repeat(32);
        assert_eq!(parse(&format!("digest=sha256:{d}")).unwrap().digest, Some([0xab; 32]));
    }
}
