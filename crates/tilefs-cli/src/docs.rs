//! `tilefs completions` and `tilefs man`: shell completions and man pages,
//! generated from the same definitions as `--help`.

use anyhow::{Context, Result};
use clap::{Args, CommandFactory};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct CompletionsArgs {
    /// The shell
    pub shell: clap_complete::Shell,
}

#[derive(Args)]
pub struct ManArgs {
    /// Directory to write tilefs.1 and tilefs-COMMAND.1 into (created if needed)
    pub dir: PathBuf,
}

pub fn completions<C: CommandFactory>(a: CompletionsArgs) -> Result<ExitCode> {
    let mut cmd = C::command();
    let name = cmd.get_name().to_string();
    clap_complete::generate(a.shell, &mut cmd, name, &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

pub fn man<C: CommandFactory>(a: ManArgs) -> Result<ExitCode> {
    std::fs::create_dir_all(&a.dir).with_context(|| format!("cannot create {}", a.dir.display()))?;
    let cmd = C::command();
    let cannot = || format!("cannot write man pages into {}", a.dir.display());
    let name = cmd.get_name().to_string();
    let mut written = vec![a.dir.join(format!("{name}.1"))];
    written.extend(
        cmd.get_subcommands()
            .filter(|c| !c.is_hide_set())
            .map(|c| a.dir.join(format!("{name}-{}.1", c.get_name()))),
    );
    clap_mangen::generate_to(cmd, &a.dir).with_context(cannot)?;
    written.retain(|p| p.exists());
    let path = a.dir.join("mount.tilefs.8");
    let mut out = Vec::new();
    clap_mangen::Man::new(mount_helper_command())
        .section("8")
        .render(&mut out)
        .with_context(cannot)?;
    std::fs::write(&path, out).with_context(|| format!("{}", path.display()))?;
    written.push(path);
    for p in written {
        println!("{}", p.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// mount.tilefs's command line, described for its man page (the helper
/// parses mount(8)'s conventions itself; see mount_helper.rs).
fn mount_helper_command() -> clap::Command {
    use clap::{Arg, ArgAction, Command};
    Command::new("mount.tilefs")
        .about("Mount a tilefs (composefs) image: the helper mount(8) runs for `mount -t tilefs`")
        .long_about(
            "Called by mount(8) for `mount -t tilefs IMAGE DIR -o store=STORE[,OPTIONS]` and for fstab \
             lines of type tilefs, for example:\n\n  \
             os:1  /srv/os  tilefs  store=/var/lib/tilefs/store,ro  0 0\n\n\
             It is the tilefs binary run under the name mount.tilefs (scripts/install links it); it \
             mounts as `tilefs mount` does and exits with mount(8)'s statuses: 1 for a usage or \
             permission error, 32 when the mount failed.",
        )
        .arg(
            Arg::new("image")
                .value_name("IMAGE")
                .required(true)
                .help("Image file, or a tag in the store"),
        )
        .arg(
            Arg::new("dir")
                .value_name("MOUNTPOINT")
                .required(true)
                .help("Where to mount"),
        )
        .arg(Arg::new("options").short('o').value_name("OPTIONS").help(
            "store=DIR (required; also basedir=DIR[:DIR...]), upper=DIR and work=DIR (writable), \
             verity=require|auto|off, digest=HEX, ro, rw, nosuid, nodev, noexec, noatime, relatime, \
             kernel, fuse; options for mount(8) itself (noauto, user, nofail, x-*) are ignored; \
             anything else is passed to overlayfs",
        ))
        .arg(
            Arg::new("fake")
                .short('f')
                .action(ArgAction::SetTrue)
                .help("Check everything, mount nothing"),
        )
        .arg(
            Arg::new("sloppy")
                .short('s')
                .action(ArgAction::SetTrue)
                .help("Accepted (sloppy)"),
        )
        .arg(
            Arg::new("no-mtab")
                .short('n')
                .action(ArgAction::SetTrue)
                .help("Accepted (no mtab)"),
        )
        .arg(
            Arg::new("verbose")
                .short('v')
                .action(ArgAction::SetTrue)
                .help("Accepted (verbose)"),
        )
        .arg(
            Arg::new("namespace")
                .short('N')
                .value_name("NS")
                .help("Mount in the mount namespace NS (a PID or a /proc/PID/ns/mnt path)"),
        )
}
