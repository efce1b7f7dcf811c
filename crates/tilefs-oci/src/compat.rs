//! The rules composefs-rs applies to the tree of an OCI image, so that
//! both tools give the same image, and so the same digest, for the same
//! OCI image:
//!
//! - the root directory takes `/usr`'s mode, owner, mtime and xattrs (a
//!   layer's own entry for `/` is ignored, as runtimes ignore it); an
//!   image without `/usr` keeps a root of `0755`, owned by root, time zero;
//! - `/run` is emptied and takes `/usr`'s mtime;
//! - mtimes are the tar header's whole seconds, or a PAX record's seconds
//!   and nanoseconds;
//! - among xattrs only `security.capability` is kept, unless the caller
//!   asks for all of them (applied as layers are, [`keeps_xattr`]);
//! - the image is written in format version 1.

use tilefs_image::tree::{Tree, ROOT};

// Applied as each layer is, so defined where layers are applied.
pub use crate::apply::{keeps_xattr, KEPT_XATTR};

/// The image format version composefs-rs writes for OCI images.
pub const FORMAT_VERSION: u32 = 1;

/// The image of the layers `applier` applied, as composefs-rs writes it:
/// the tree normalized by [`normalize`] (before it is finished, so what it
/// drops is not carried over), at [`FORMAT_VERSION`]. Pulls and the
/// snapshotter's chains are written by this one function, so the two give
/// the same bytes.
pub fn write_image(
    mut applier: crate::apply::Applier,
) -> Result<(Tree, tilefs_image::erofs::Image), tilefs_image::erofs::WriteError> {
    normalize(applier.tree_mut());
    let tree = applier.finish();
    let image = tilefs_image::erofs::write_image(
        &tree,
        &tilefs_image::erofs::WriteOptions {
            min_version: FORMAT_VERSION,
            max_version: FORMAT_VERSION,
        },
    )?;
    Ok((tree, image))
}

/// Applies the other rules to the working tree of an
/// [`crate::apply::Applier`] (before its `finish`, which then counts links
/// without what was removed).
pub fn normalize(tree: &mut Tree) {
    let Some(usr) = tree.lookup_path(b"/usr").filter(|&id| tree.inode(id).is_dir()) else {
        return;
    };
    let usr = tree.inode(usr).clone();
    let root = tree.inode_mut(ROOT);
    root.mode = usr.mode;
    root.uid = usr.uid;
    root.gid = usr.gid;
    root.mtime = usr.mtime;
    root.xattrs = usr.xattrs.clone();
    if let Some(run) = tree.lookup_path(b"/run").filter(|&id| tree.inode(id).is_dir()) {
        let run = tree.inode_mut(run);
        run.entries.clear();
        run.mtime = usr.mtime;
    }
}
