//! Writing result files: atomically, so that a failed command leaves
//! nothing behind, and durably.

use anyhow::{bail, Context, Result};
use std::fs;
use std::io::{IsTerminal, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Writes `data` to `path` (or stdout for `-`): into a temporary file in the
/// same directory, synced, then renamed over `path`.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    if path.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        if out.is_terminal() {
            bail!("refusing to write a binary image to a terminal");
        }
        out.write_all(data).context("writing to stdout")?;
        return out.flush().context("writing to stdout");
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".tilefs-")
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    tmp.write_all(data)
        .and_then(|_| tmp.as_file().sync_all())
        .with_context(|| format!("writing {}", path.display()))?;
    tmp.as_file()
        .set_permissions(fs::Permissions::from_mode(0o644))
        .with_context(|| format!("setting permissions of {}", path.display()))?;
    tmp.persist(path)
        .map_err(|e| e.error)
        .with_context(|| format!("renaming the new image to {}", path.display()))?;
    Ok(())
}
