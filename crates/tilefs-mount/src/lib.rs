//! Kernel mounts of tilefs images: EROFS for the metadata, overlayfs on top
//! with the object store as a data-only lower layer.
