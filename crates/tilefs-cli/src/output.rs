//! Writing result files: atomically, so that a failed command leaves
//! nothing behind, and durably.

use anyhow::{bail, Context, Result};
use std::fs;
use std::io::{IsTerminal, Write};
use std::path::Path;

/// Checks, before any work, that `path` (or stdout for `-`) can take an
/// image: stdout is not a terminal; the directory exists and is writable;
/// `path` is not a directory.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.as_os_str() == "-" {
        if std::io::stdout().is_terminal() {
            bail!("refusing to write a binary image to a terminal");
        }
        return Ok(());
    }
    if path.is_dir() {
        bail!("{}: is a directory", quoted(path));
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => bail!("{}: not a directory", quoted(dir)),
        Err(e) => bail!("{}: {e}", quoted(dir)),
    }
    rustix::fs::access(dir, rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK)
        .map_err(|e| anyhow::anyhow!("{}: cannot write there: {}", quoted(dir), std::io::Error::from(e)))
}

/// A path for a message: as is when plain, else quoted and escaped, so a
/// newline or control character in a name cannot split or fake a line.
pub fn quoted(p: &Path) -> String {
    let s = p.to_string_lossy();
    if s.chars().any(|c| c.is_control() || c == '"') || s.contains(char::REPLACEMENT_CHARACTER) {
        format!("{:?}", p)
    } else {
        s.into_owned()
    }
}

/// Writes `data` to `path` (or stdout for `-`), replacing it atomically
/// (see [`tilefs_sys::fs::replace`]).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    if path.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        if out.is_terminal() {
            bail!("refusing to write a binary image to a terminal");
        }
        out.write_all(data).context("writing to stdout")?;
        return out.flush().context("writing to stdout");
    }
    write_atomic_with(path, |f| {
        let mut f: &fs::File = f;
        f.write_all(data).with_context(|| format!("writing {}", path.display()))
    })
}

/// Like [`write_atomic`] (not for stdout), `write` filling the temporary
/// file; nothing is left behind if it fails.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&fs::File) -> Result<()>) -> Result<()> {
    tilefs_sys::fs::replace(path, 0o644, write)
}
