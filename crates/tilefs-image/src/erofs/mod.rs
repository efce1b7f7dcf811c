//! EROFS images in the composefs layout.

pub mod format;
pub mod reader;
pub mod view;
pub mod writer;

pub use reader::{image_version, read_image, read_info, root_owner, ImageError, ImageInfo};
pub use view::ImageView;
pub use writer::{write_flat, write_flat_to, write_image, Image, WriteError, WriteOptions};
