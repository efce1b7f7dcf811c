//! `tilefs`: build, inspect, store and mount composefs-compatible images.

mod build;
mod commit_cmd;
mod convert_cmd;
mod digest;
mod docs;
mod fuse_serve;
mod index_cmd;
mod inspect;
mod keys_cmd;
mod layer_store_cmd;
mod lazy_serve;
mod logging;
mod mount_cmd;
mod mount_helper;
mod mountd_cmd;
mod once;
mod output;
mod present_args;
mod progress;
mod pull_cmd;
mod push_cmd;
mod registry_arg;
mod serve_cmd;
mod snapshotter_cmd;
mod store_arg;
mod store_cmds;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// `tilefs --version`: the release and the commit it was built from.
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TILEFS_COMMIT"), ")");

#[derive(Parser)]
#[command(
    name = "tilefs",
    version = VERSION,
    about = "Build, inspect and mount composefs-compatible file tree images",
    long_about = "tilefs stores file trees as small reproducible EROFS metadata images plus a shared, \
                  content-addressed object store, compatible byte for byte with composefs."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build an image from a directory or a composefs-dump(5) file
    Build(build::BuildArgs),
    /// Print an image as composefs-dump(5) text
    Dump(inspect::DumpArgs),
    /// Summarise an image: version, counts by file type, sizes, objects
    Info(inspect::InfoArgs),
    /// List the object paths (XX/YYYY...) an image references, one a line
    Objects(inspect::ObjectsArgs),
    /// Pull an OCI image (layout, archive or registry) into the store as a tagged image
    Pull(pull_cmd::PullArgs),
    /// Push a tagged image and its objects to an OCI registry (fetchable by range, lazily)
    Push(push_cmd::PushArgs),
    /// Convert an OCI image in a registry to a runnable tilefs artifact in a registry (no store of
    /// yours: its layers are read once into a scratch store)
    Convert(convert_cmd::ConvertArgs),
    /// Index an ordinary OCI image in a registry so that it is pulled and mounted lazily as it is
    /// (pushes a small artifact that refers to the image)
    Index(index_cmd::IndexArgs),
    /// Write a sigstore key pair (PREFIX.key, encrypted, and PREFIX.pub) for signed pushes
    GenerateSigstoreKey(keys_cmd::GenerateSigstoreKeyArgs),
    /// Print the fs-verity SHA-256 digest of files, as `fsverity digest` does
    Digest(digest::DigestArgs),
    /// List the images tagged in a store, and apart those tilefs holds (the snapshotter's)
    Images(store_cmds::ImagesArgs),
    /// Remove a tag from a store (not an image tilefs holds), or images whose holder is gone
    Untag(store_cmds::UntagArgs),
    /// Check every object and the references of every tagged and held image in a store
    Fsck(store_cmds::FsckArgs),
    /// Remove objects no tagged or held image and no live mount references, and leftovers of
    /// interrupted imports
    Gc(store_cmds::GcArgs),
    /// Mount an image read-only (or writable with --upper/--work)
    Mount(mount_cmd::MountArgs),
    /// Serve an image to a virtual machine: a vhost-user-fs (virtio-fs) device backend
    Serve(serve_cmd::ServeArgs),
    /// Unmount what `tilefs mount` mounted
    Umount(mount_cmd::UmountArgs),
    /// Turn a writable mount's tree into a new tagged image, digesting only what changed
    #[command(
        long_about = "Turn the tree a writable tilefs mount (kernel or FUSE, made with --upper and \
                            --work) shows into a new image in the store it was mounted with, tagged NAME: \
                            the same bytes `tilefs build --store STORE MOUNTPOINT` gives, but only the files \
                            of the upper directory are digested; the image's files are never read again. \
                            The mount is synced first; what was written before the commit started is in \
                            it. A failed commit tags nothing and leaves no image. Prints the new image's \
                            fs-verity digest."
    )]
    Commit(commit_cmd::CommitArgs),
    /// Run the mount service: kernel mounts of trusted images for unprivileged users (as root)
    #[command(long_about = mountd_cmd::LONG_ABOUT)]
    Mountd(mountd_cmd::MountdArgs),
    /// Serve containerd's snapshots API (a proxy plugin): layers in the shared store, containers on kernel mounts
    Snapshotter(snapshotter_cmd::SnapshotterArgs),
    /// Serve an additional layer store for podman: images with a tilefs index pulled without their layers
    #[command(long_about = layer_store_cmd::LONG_ABOUT)]
    LayerStore(layer_store_cmd::LayerStoreArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    Completions(docs::CompletionsArgs),
    /// Write man pages (tilefs(1), tilefs-COMMAND(1), mount.tilefs(8)) into a directory
    Man(docs::ManArgs),
}

/// A message as one line: a newline or other control character (in a file
/// name, say) is shown escaped and cannot start a line of its own.
fn one_line(msg: &str) -> String {
    msg.chars()
        .flat_map(|c| -> Box<dyn Iterator<Item = char>> {
            if c.is_control() {
                Box::new(c.escape_default())
            } else {
                Box::new(std::iter::once(c))
            }
        })
        .collect()
}

fn main() -> ExitCode {
    // mount(8) runs us as mount.tilefs (a link to this binary).
    let name = std::env::args_os().next().map(std::path::PathBuf::from);
    if name
        .as_deref()
        .and_then(|n| n.file_name())
        .is_some_and(|n| n == "mount.tilefs")
    {
        // A FUSE server forked from here closes them (see fuse_serve).
        tilefs_sys::process::note_inherited_fds();
        logging::init("mount.tilefs");
        return mount_helper::main();
    }
    logging::init("tilefs");
    // The mount service starts its helper as `tilefs mountd --helper`: an
    // internal entry point, kept out of clap so that neither --help nor a
    // shell completion offers it.
    if std::env::args_os().skip(1).eq(mountd_cmd::HELPER_ARGS) {
        return mountd_cmd::helper();
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Build(a) => build::run(a),
        Command::Dump(a) => inspect::dump(a),
        Command::Info(a) => inspect::info(a),
        Command::Objects(a) => inspect::objects(a),
        Command::Digest(a) => digest::run(a),
        Command::Pull(a) => pull_cmd::run(a),
        Command::Push(a) => push_cmd::run(a),
        Command::Convert(a) => convert_cmd::run(a),
        Command::Index(a) => index_cmd::run(a),
        Command::GenerateSigstoreKey(a) => keys_cmd::run(a),
        Command::Images(a) => store_cmds::images(a),
        Command::Untag(a) => store_cmds::untag(a),
        Command::Fsck(a) => store_cmds::fsck(a),
        Command::Gc(a) => store_cmds::gc(a),
        Command::Mount(a) => {
            // Before anything is opened: see fuse_serve.
            tilefs_sys::process::note_inherited_fds();
            mount_cmd::mount(a)
        }
        Command::Serve(a) => serve_cmd::run(a),
        Command::Umount(a) => mount_cmd::umount(a),
        Command::Commit(a) => commit_cmd::run(a),
        Command::Mountd(a) => mountd_cmd::run(a),
        Command::Snapshotter(a) => snapshotter_cmd::run(a),
        Command::LayerStore(a) => layer_store_cmd::run(a),
        Command::Completions(a) => docs::completions::<Cli>(a),
        Command::Man(a) => docs::man::<Cli>(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // A closed pipe (`tilefs dump img | head`) is not an error.
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if io.kind() == std::io::ErrorKind::BrokenPipe {
                    return ExitCode::SUCCESS;
                }
            }
            if e.downcast_ref::<build::Interrupted>().is_some() {
                eprintln!("tilefs: interrupted");
                return ExitCode::from(130);
            }
            eprintln!("tilefs: {}", one_line(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}
