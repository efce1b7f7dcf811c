//! Puts the commit tilefs was built from into `--version`.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

/// A file of the repository, found as git finds it (worktrees included).
fn git_path(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(git(&["rev-parse", "--git-path", name])?);
    Some(if p.is_absolute() {
        p
    } else {
        std::env::current_dir().ok()?.join(p)
    })
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]);
    println!(
        "cargo:rustc-env=TILEFS_COMMIT={}",
        commit.as_deref().unwrap_or("unknown commit")
    );
    // Built again when HEAD moves (a new commit or a checkout).
    let mut watch = vec![git_path("HEAD"), git_path("packed-refs")];
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(git_path(&r));
    }
    // Only files that exist: cargo takes a missing one (a repository
    // without packed-refs) as changed, and would build tilefs every time.
    for p in watch.into_iter().flatten().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}
