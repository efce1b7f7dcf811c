//! Applying layers, in order, into one tree, with the OCI image layer
//! rules: a later entry replaces an earlier one of the same path (a
//! directory over a directory only updates its metadata), `.wh.NAME`
//! removes NAME from the layers below, `.wh..wh..opq` hides what the
//! layers below hold in its directory, hardlinks name the inode of their
//! target, and parent directories a layer does not list are created as
//! runtimes create them (`0755`, owned by root, time zero).
//!
//! Whiteouts and opaque markers apply to the layers below only, never to
//! entries of their own layer, wherever they sit in the tar stream: each
//! layer's whiteouts are applied first, then its other entries.
//!
//! An opaque marker of the root (`.wh..wh..opq` or `./.wh..wh..opq`) hides
//! nothing, as a container sees it on containerd's overlayfs snapshotter
//! and on tilefs's: containerd applies it as `trusted.overlay.opaque` on
//! the layer's upper directory, and the kernel's overlayfs ignores that
//! xattr on a layer's root (only a directory below the root is ever
//! opaque). A pull therefore shows the layers below the root's marker, as
//! the containers do.
//!
//! The working tree is an arena where removed inodes simply stop being
//! reachable; [`Applier::finish`] walks what is reachable into a compact
//! [`Tree`] whose link counts and primary entries follow the order of a
//! dump (depth first, by name): the first name of a hardlinked file is
//! its primary entry.

use crate::layer::{display_components, Content, Kind, LayerEntry, Meta};
use crate::OciError;
use rustc_hash::FxHashMap;
use tilefs_image::tree::{
    digest_object_path, Inode, InodeId, Tree, TreeError, IMAGE_XATTR_BUDGET, ROOT, S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT,
    S_IFREG,
};

/// The one xattr composefs-rs keeps from layers (see [`crate::compat`]).
pub const KEPT_XATTR: &[u8] = b"security.capability";

/// Whether the image keeps a layer's xattr `key`.
pub fn keeps_xattr(key: &[u8], keep_all_xattrs: bool) -> bool {
    keep_all_xattrs || key == KEPT_XATTR
}

/// Mode of directories a layer implies but does not list.
const IMPLIED_DIR_MODE: u32 = S_IFDIR | 0o755;

/// The tree as the layers applied so far make it.
pub struct Applier {
    tree: Tree,
    keep_all_xattrs: bool,
}

impl Applier {
    /// An empty root directory (`0755`, root-owned, time zero); the
    /// composefs-rs rules later give it `/usr`'s metadata. Entries get the
    /// xattrs [`keeps_xattr`] keeps: those dropped are never
    /// checked against the limits, as composefs-rs never checks them.
    pub fn new(keep_all_xattrs: bool) -> Applier {
        Applier {
            tree: Tree::new(Inode::new(IMPLIED_DIR_MODE)),
            keep_all_xattrs,
        }
    }

    /// The working tree (before [`Applier::finish`]): rules that remove
    /// entries (see [`crate::compat`]) apply here, before link counts and
    /// primary entries are decided.
    pub fn tree_mut(&mut self) -> &mut Tree {
        &mut self.tree
    }

    /// Applies one layer's entries. `blob` names the layer in messages.
    pub fn apply_layer(&mut self, blob: &str, entries: Vec<LayerEntry>) -> Result<(), OciError> {
        let (removals, others) = split_layer(entries);
        for e in &removals {
            self.remove(e)
                .map_err(|r| OciError::layer(blob, Some(&whiteout_name(e)), r))?;
        }
        self.add_all(blob, others)?;
        // An opaque directory exists in its layer even if the layer forgot
        // its entry.
        for e in removals.iter().filter(|e| e.kind == Kind::Opaque) {
            self.dir_at(&e.path)
                .map_err(|r| OciError::layer(blob, Some(&whiteout_name(e)), r))?;
        }
        Ok(())
    }

    /// Makes the tree one layer's diff, as overlayfs takes it for a lower
    /// layer of its own (podman's additional layer stores): its entries,
    /// each whiteout a character device 0/0 and each opaque directory
    /// marked `overlay.opaque` = `y` (`trusted.` for root's overlay mounts,
    /// `user.` for a rootless user's). An entry of the layer itself wins
    /// over its whiteout of the same name, which applies only below.
    pub fn apply_diff(&mut self, blob: &str, entries: Vec<LayerEntry>) -> Result<(), OciError> {
        let (removals, others) = split_layer(entries);
        self.add_all(blob, others)?;
        for e in &removals {
            self.mark(e)
                .map_err(|r| OciError::layer(blob, Some(&whiteout_name(e)), r))?;
        }
        Ok(())
    }

    /// Adds `entries` (of layer `blob`), in the order [`split_layer`] gives.
    fn add_all(&mut self, blob: &str, entries: Vec<LayerEntry>) -> Result<(), OciError> {
        for mut e in entries {
            self.add(&mut e)
                .map_err(|r| OciError::layer(blob, Some(&e.display_path()), r))?;
        }
        Ok(())
    }

    /// A whiteout or opaque marker kept in a diff (see [`Applier::apply_diff`]).
    fn mark(&mut self, e: &LayerEntry) -> Result<(), String> {
        match e.kind {
            // The root's marker hides nothing (see the module's doc).
            Kind::Opaque if e.path.is_empty() => Ok(()),
            Kind::Opaque => {
                let dir = self.dir_at(&e.path)?;
                let inode = self.tree.inode_mut(dir);
                let mut xattrs: Vec<(Vec<u8>, Vec<u8>)> = inode
                    .xattrs
                    .iter()
                    .filter(|x| !x.key.ends_with(b".overlay.opaque"))
                    .map(|x| (x.key.clone(), x.value.clone()))
                    .collect();
                xattrs.push((b"trusted.overlay.opaque".to_vec(), b"y".to_vec()));
                xattrs.push((b"user.overlay.opaque".to_vec(), b"y".to_vec()));
                inode
                    .set_xattrs(xattrs.iter().map(|(k, v)| (k, v)), IMAGE_XATTR_BUDGET)
                    .map_err(tree_error)
            }
            _ => {
                let (name, parent_path) = e.path.split_last().expect("a whiteout names an entry");
                let parent = self.dir_at(parent_path)?;
                if self.tree.inode(parent).entry(name).is_some() {
                    return Ok(());
                }
                let mut w = Inode::new(tilefs_image::tree::S_IFCHR);
                w.uid = e.meta.uid;
                w.gid = e.meta.gid;
                w.mtime = e.meta.mtime;
                self.tree.add_child(parent, name, w).map_err(tree_error)?;
                Ok(())
            }
        }
    }

    fn remove(&mut self, e: &LayerEntry) -> Result<(), String> {
        match e.kind {
            // The root's marker: see the module's doc.
            Kind::Opaque if e.path.is_empty() => Ok(()),
            Kind::Opaque => {
                // Only a directory below has contents to hide.
                if let Some(id) = self.lookup(&e.path)? {
                    let inode = self.tree.inode_mut(id);
                    if inode.is_dir() {
                        inode.entries.clear();
                    }
                }
                Ok(())
            }
            _ => {
                let (name, parent) = e.path.split_last().expect("a whiteout names an entry");
                let dir = self
                    .lookup(parent)?
                    .filter(|&d| self.tree.inode(d).is_dir())
                    .ok_or_else(|| {
                        "whiteout of something absent (its directory is not in the layers below)".to_string()
                    })?;
                let entries = &mut self.tree.inode_mut(dir).entries;
                match entries.binary_search_by(|x| x.name.as_slice().cmp(name)) {
                    Ok(pos) => {
                        entries.remove(pos);
                        Ok(())
                    }
                    Err(_) => Err("whiteout of something absent (not in the layers below)".to_string()),
                }
            }
        }
    }

    fn add(&mut self, e: &mut LayerEntry) -> Result<(), String> {
        let kind = std::mem::replace(&mut e.kind, Kind::Fifo);
        let LayerEntry { path, meta, .. } = e;
        let Some((name, parent_path)) = path.split_last() else {
            // The root's own entry: its metadata, like any directory's.
            set_meta(
                self.tree.inode_mut(ROOT),
                meta.perm | S_IFDIR,
                meta,
                self.keep_all_xattrs,
            )?;
            return Ok(());
        };
        let parent = self.dir_at(parent_path)?;
        let existing = self.tree.inode(parent).entry(name).map(|x| x.inode);
        let mut inode = match kind {
            Kind::Dir => {
                if let Some(id) = existing.filter(|&id| self.tree.inode(id).is_dir()) {
                    // A directory over a directory: the newer metadata, the
                    // union of the contents.
                    return set_meta(self.tree.inode_mut(id), meta.perm | S_IFDIR, meta, self.keep_all_xattrs);
                }
                Inode::new(S_IFDIR)
            }
            Kind::File { size, content } => {
                let mut i = Inode::new(S_IFREG);
                i.size = size;
                match content {
                    Content::Inline(data) => i.content = (!data.is_empty()).then_some(data),
                    Content::Object(d) => {
                        i.payload = Some(digest_object_path(&d).into_bytes());
                        i.digest = Some(d);
                    }
                    Content::Pending(_) => return Err("contents not stored (an internal error)".into()),
                }
                i
            }
            Kind::Symlink(target) => {
                let mut i = Inode::new(S_IFLNK);
                i.size = target.len() as u64;
                i.payload = Some(target);
                i
            }
            Kind::Device { mode_type, rdev } => {
                let mut i = Inode::new(mode_type);
                i.rdev = rdev;
                i
            }
            Kind::Fifo => Inode::new(S_IFIFO),
            Kind::Hardlink(target) => {
                let id = self
                    .lookup(&target)?
                    .ok_or_else(|| format!("hardlink to a missing target {}", display_components(&target)))?;
                if self.tree.inode(id).is_dir() {
                    return Err(format!("hardlink to a directory ({})", display_components(&target)));
                }
                if existing == Some(id) {
                    return Ok(());
                }
                self.unlink(parent, name);
                self.tree.link(parent, name, id, false).map_err(tree_error)?;
                return Ok(());
            }
            Kind::Whiteout | Kind::Opaque => unreachable!("applied before"),
        };
        let type_bits = inode.mode & S_IFMT;
        set_meta(&mut inode, meta.perm | type_bits, meta, self.keep_all_xattrs)?;
        self.unlink(parent, name);
        self.tree.add_child(parent, name, inode).map_err(tree_error)?;
        Ok(())
    }

    fn unlink(&mut self, dir: InodeId, name: &[u8]) {
        let entries = &mut self.tree.inode_mut(dir).entries;
        if let Ok(pos) = entries.binary_search_by(|x| x.name.as_slice().cmp(name)) {
            entries.remove(pos);
        }
    }

    /// The inode at `path`, if any. Parents must be directories: a
    /// symlinked parent is refused, never followed.
    fn lookup(&self, path: &[Vec<u8>]) -> Result<Option<InodeId>, String> {
        let mut cur = ROOT;
        for (i, comp) in path.iter().enumerate() {
            let inode = self.tree.inode(cur);
            if !inode.is_dir() {
                return Err(not_a_dir(inode, &path[..i]));
            }
            match inode.entry(comp) {
                Some(e) => cur = e.inode,
                None => return Ok(None),
            }
        }
        Ok(Some(cur))
    }

    /// The directory at `path`, creating missing ones.
    fn dir_at(&mut self, path: &[Vec<u8>]) -> Result<InodeId, String> {
        let mut cur = ROOT;
        for (i, comp) in path.iter().enumerate() {
            cur = match self.tree.inode(cur).entry(comp).map(|e| e.inode) {
                Some(id) => {
                    let inode = self.tree.inode(id);
                    if !inode.is_dir() {
                        return Err(not_a_dir(inode, &path[..=i]));
                    }
                    id
                }
                None => self
                    .tree
                    .add_child(cur, comp, Inode::new(IMPLIED_DIR_MODE))
                    .map_err(tree_error)?,
            };
        }
        Ok(cur)
    }

    /// The tree the layers make: only what is reachable, each inode once,
    /// link counts counted, the first name (in dump order) of each file its
    /// primary entry.
    pub fn finish(self) -> Tree {
        let mut old = self.tree;
        let root_entries = std::mem::take(&mut old.inode_mut(ROOT).entries);
        let mut new = Tree::new(old.inode(ROOT).clone());
        old.inode_mut(ROOT).entries = root_entries;
        let mut seen: FxHashMap<InodeId, InodeId> = FxHashMap::default();
        // Depth first, by name: the order of a dump.
        let mut stack: Vec<(InodeId, InodeId, usize)> = vec![(ROOT, ROOT, 0)];
        while let Some((old_dir, new_dir, pos)) = stack.pop() {
            let Some(e) = old.inode(old_dir).entries.get(pos) else {
                continue;
            };
            stack.push((old_dir, new_dir, pos + 1));
            if let Some(&id) = seen.get(&e.inode) {
                new.inode_mut(id).nlink += 1;
                new.inode_mut(new_dir).entries.push(tilefs_image::tree::Entry {
                    name: e.name.clone(),
                    inode: id,
                    hardlink: true,
                });
                continue;
            }
            let (child, name) = (e.inode, e.name.clone());
            // Each inode is moved once (a second name is a hardlink above);
            // a directory keeps its entries in the old tree for the walk.
            let src = old.inode_mut(child);
            let is_dir = src.is_dir();
            let entries = std::mem::take(&mut src.entries);
            let moved = Inode {
                nlink: 1,
                ..std::mem::take(src)
            };
            old.inode_mut(child).entries = entries;
            let id = new.add_inode(moved);
            new.inode_mut(new_dir).entries.push(tilefs_image::tree::Entry {
                name,
                inode: id,
                hardlink: false,
            });
            if is_dir {
                stack.push((child, id, 0));
            } else {
                seen.insert(child, id);
            }
        }
        new
    }
}

/// A layer's whiteouts and opaque markers, apart from its other entries
/// in the order they are added: by path (stable: a later entry of one path
/// still wins), so each directory's entries arrive sorted and are
/// appended, not inserted; hardlinks after every file they may name, in
/// their own order.
fn split_layer(entries: Vec<LayerEntry>) -> (Vec<LayerEntry>, Vec<LayerEntry>) {
    let (removals, others): (Vec<_>, Vec<_>) = entries
        .into_iter()
        .partition(|e| matches!(e.kind, Kind::Whiteout | Kind::Opaque));
    let (links, mut others): (Vec<_>, Vec<_>) = others.into_iter().partition(|e| matches!(e.kind, Kind::Hardlink(_)));
    others.sort_by(|a, b| a.path.cmp(&b.path));
    others.extend(links);
    (removals, others)
}

fn set_meta(inode: &mut Inode, mode: u32, meta: &Meta, keep_all_xattrs: bool) -> Result<(), String> {
    inode.mode = mode;
    inode.uid = meta.uid;
    inode.gid = meta.gid;
    inode.mtime = meta.mtime;
    inode.xattrs.clear();
    // Every xattr within its own limits fits: an inode may use what EROFS
    // holds.
    let kept = meta
        .xattrs
        .iter()
        .filter(|(k, _)| keeps_xattr(k, keep_all_xattrs))
        .map(|(k, v)| (k, v));
    inode.set_xattrs(kept, IMAGE_XATTR_BUDGET).map_err(tree_error)
}

fn not_a_dir(inode: &Inode, path: &[Vec<u8>]) -> String {
    let what = inode.file_type().map_or("not a directory", |t| t.name());
    if inode.mode & S_IFMT == S_IFLNK {
        format!(
            "parent {} is a symlink (entries are never placed through symlinks)",
            display_components(path)
        )
    } else {
        format!("parent {} is a {what}, not a directory", display_components(path))
    }
}

fn whiteout_name(e: &LayerEntry) -> String {
    match e.kind {
        Kind::Opaque => {
            let mut p = e.path.clone();
            p.push(crate::layer::OPAQUE_MARKER.to_vec());
            display_components(&p)
        }
        _ => {
            let mut p = e.path.clone();
            if let Some(last) = p.last_mut() {
                let mut n = crate::layer::WHITEOUT_PREFIX.to_vec();
                n.extend_from_slice(last);
                *last = n;
            }
            display_components(&p)
        }
    }
}

fn tree_error(e: TreeError) -> String {
    e.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Vec<Vec<u8>> {
        crate::layer::split_path(s.as_bytes()).unwrap()
    }
    fn e(path: &str, kind: Kind) -> LayerEntry {
        LayerEntry {
            path: p(path),
            kind,
            meta: Meta {
                perm: 0o644,
                ..Meta::default()
            },
        }
    }
    fn file(path: &str, data: &str) -> LayerEntry {
        e(
            path,
            Kind::File {
                size: data.len() as u64,
                content: Content::Inline(data.as_bytes().to_vec()),
            },
        )
    }
    fn names(t: &Tree, path: &str) -> Vec<String> {
        let id = t.lookup_path(path.as_bytes()).unwrap();
        t.inode(id)
            .entries
            .iter()
            .map(|e| String::from_utf8_lossy(&e.name).into_owned())
            .collect()
    }

    #[test]
    fn whiteouts_and_opaque_dirs_hide_lower_layers_only() {
        let mut a = Applier::new(false);
        a.apply_layer(
            "l1",
            vec![e("d", Kind::Dir), file("d/a", "1"), file("d/b", "2"), file("x", "x")],
        )
        .unwrap();
        a.apply_layer(
            "l2",
            vec![
                // The new file comes before the marker: it stays.
                file("d/c", "3"),
                e("d", Kind::Opaque),
                e("x", Kind::Whiteout),
            ],
        )
        .unwrap();
        let t = a.finish();
        assert_eq!(names(&t, "/d"), ["c"]);
        assert!(t.lookup_path(b"/x").is_none());
    }

    /// A diff (podman's layer store) keeps a layer's whiteouts as devices
    /// 0/0 and marks its opaque directories, its own files winning over a
    /// whiteout of the same name; the root's marker marks nothing.
    #[test]
    fn a_diff_keeps_whiteouts_and_opaque_markers() {
        let mut a = Applier::new(true);
        a.apply_diff(
            "l2",
            vec![
                file("d/c", "3"),
                e("d", Kind::Opaque),
                e("gone", Kind::Whiteout),
                e("e/deep", Kind::Whiteout),
                e("back", Kind::Whiteout),
                file("back", "again"),
                e("", Kind::Opaque),
            ],
        )
        .unwrap();
        let t = a.finish();
        assert_eq!(names(&t, "/"), ["back", "d", "e", "gone"]);
        let at = |path: &str| t.inode(t.lookup_path(path.as_bytes()).unwrap());
        for w in ["/gone", "/e/deep"] {
            assert!(at(w).is_whiteout(), "{w}");
        }
        assert!(at("/back").is_reg());
        let keys = |path: &str| -> Vec<(Vec<u8>, Vec<u8>)> {
            at(path)
                .xattrs
                .iter()
                .map(|x| (x.key.clone(), x.value.clone()))
                .collect()
        };
        assert_eq!(
            keys("/d"),
            [
                (b"trusted.overlay.opaque".to_vec(), b"y".to_vec()),
                (b"user.overlay.opaque".to_vec(), b"y".to_vec())
            ]
        );
        assert!(keys("/").is_empty() && keys("/e").is_empty());
    }

    /// Issue 43: the root's opaque marker hides nothing, as overlayfs
    /// ignores an opaque layer root (what containers see).
    #[test]
    fn an_opaque_root_hides_nothing() {
        let mut a = Applier::new(false);
        a.apply_layer("l1", vec![e("d", Kind::Dir), file("d/a", "1"), file("x", "x")])
            .unwrap();
        a.apply_layer("l2", vec![e("", Kind::Opaque), file("y", "y")]).unwrap();
        let t = a.finish();
        assert_eq!(names(&t, "/"), ["d", "x", "y"]);
        assert_eq!(names(&t, "/d"), ["a"]);
    }

    #[test]
    fn whiteout_of_something_absent_is_an_error() {
        let mut a = Applier::new(false);
        let err = a.apply_layer("l1", vec![e("nope", Kind::Whiteout)]).unwrap_err();
        assert!(err.to_string().contains(".wh.nope"), "{err}");
        assert!(err.to_string().contains("absent"), "{err}");
    }

    #[test]
    fn replacements_and_hardlinks() {
        let mut a = Applier::new(false);
        a.apply_layer(
            "l1",
            vec![
                file("f", "file"),
                e("f2", Kind::Hardlink(p("f"))),
                e("d", Kind::Dir),
                file("d/x", "x"),
            ],
        )
        .unwrap();
        // A file becomes a directory and a directory a file.
        a.apply_layer("l2", vec![e("f", Kind::Dir), file("d", "now a file")])
            .unwrap();
        let t = a.finish();
        assert!(t.inode(t.lookup_path(b"/f").unwrap()).is_dir());
        let d = t.inode(t.lookup_path(b"/d").unwrap());
        assert!(d.is_reg());
        // The second name keeps the old file, now its only name.
        let f2 = t.inode(t.lookup_path(b"/f2").unwrap());
        assert_eq!((f2.content.as_deref(), f2.nlink), (Some(&b"file"[..]), 1));
        let err = Applier::new(false)
            .apply_layer("l", vec![e("h", Kind::Hardlink(p("missing")))])
            .unwrap_err();
        assert!(err.to_string().contains("missing target missing"), "{err}");
    }

    #[test]
    fn hardlinks_share_an_inode_whose_first_name_is_primary() {
        let mut a = Applier::new(false);
        a.apply_layer("l1", vec![file("z", "data"), e("a", Kind::Hardlink(p("z")))])
            .unwrap();
        let t = a.finish();
        let root = t.root();
        assert_eq!(root.entries[0].name, b"a");
        assert!(!root.entries[0].hardlink && root.entries[1].hardlink);
        assert_eq!(root.entries[0].inode, root.entries[1].inode);
        assert_eq!(t.inode(root.entries[0].inode).nlink, 2);
    }

    #[test]
    fn parents_are_implied_but_never_symlinks() {
        let mut a = Applier::new(false);
        a.apply_layer("l1", vec![file("a/b/c", "c")]).unwrap();
        let t = a.finish();
        let b = t.inode(t.lookup_path(b"/a/b").unwrap());
        assert_eq!((b.mode, b.uid, b.mtime.sec, b.mtime.nsec), (IMPLIED_DIR_MODE, 0, 0, 0));
        let mut a = Applier::new(false);
        a.apply_layer("l1", vec![e("etc", Kind::Symlink(b"/etc".to_vec()))])
            .unwrap();
        let err = a.apply_layer("l2", vec![file("etc/passwd", "x")]).unwrap_err();
        assert!(err.to_string().contains("symlink"), "{err}");
    }
}
