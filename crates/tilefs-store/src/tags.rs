//! Tagged images: `STORE/images/NAME`, the roots `gc` keeps alive.

use crate::{Store, StoreError};
use std::path::{Path, PathBuf};

/// One tagged image.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TagInfo {
    pub name: String,
    pub path: PathBuf,
    pub image_bytes: u64,
}

/// A tag name: 1-255 bytes of `[A-Za-z0-9._:@+-]`, not starting with `.`.
pub fn validate_tag(_name: &str) -> Result<(), StoreError> {
    todo!()
}

/// Path of a tag's image (which may not exist).
pub fn tag_path(store: &Store, name: &str) -> PathBuf {
    store.join(crate::store::IMAGES_DIR).join(name)
}

/// Records `image` under `name`, atomically (replacing an older image).
pub fn write_tag(_store: &Store, _name: &str, _image: &[u8]) -> Result<PathBuf, StoreError> {
    todo!()
}

/// Every tag, sorted by name.
pub fn list_tags(_store: &Store) -> Result<Vec<TagInfo>, StoreError> {
    todo!()
}

/// Removes a tag (its objects stay until `gc`).
pub fn remove_tag(_store: &Store, _name: &str) -> Result<(), StoreError> {
    todo!()
}

/// An IMAGE argument: an existing file, or else a tag in `store`.
pub fn resolve_image(_store: Option<&Store>, _arg: &Path) -> Result<PathBuf, StoreError> {
    todo!()
}
