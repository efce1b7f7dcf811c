//! EROFS images in the composefs layout.

pub mod format;
pub mod reader;
pub mod writer;

pub use reader::{read_image, ImageError, ImageInfo};
pub use writer::{write_image, WriteError, WriteOptions};
