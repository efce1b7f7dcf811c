//! On-disk constants and layouts of EROFS and the composefs header.
//! These are format facts (from the kernel's erofs_fs.h and the composefs
//! image header); every offset below is in bytes, little-endian.

/// composefs header at offset 0.
pub const COMPOSEFS_MAGIC: u32 = 0xd078_629a;
/// composefs header format version (not the image's composefs version).
pub const COMPOSEFS_HEADER_VERSION: u32 = 1;
/// Header flag: some inode has a POSIX ACL xattr.
pub const COMPOSEFS_FLAG_HAS_ACL: u32 = 1;
/// Size of the composefs header (magic, version, flags, composefs_version,
/// 4 unused words).
pub const COMPOSEFS_HEADER_SIZE: usize = 32;
/// Highest composefs image version we write and read.
pub const COMPOSEFS_VERSION_MAX: u32 = 1;

pub const EROFS_SUPER_OFFSET: usize = 1024;
pub const EROFS_SUPER_MAGIC: u32 = 0xe0f5_e1e2;
pub const EROFS_SUPER_SIZE: usize = 128;
pub const BLOCK_BITS: u32 = 12;
pub const BLOCK_SIZE: u64 = 1 << BLOCK_BITS;
/// Inodes are addressed in 32-byte slots (nid = offset / 32 from meta_blkaddr).
pub const SLOT_BITS: u32 = 5;
pub const SLOT_SIZE: u64 = 1 << SLOT_BITS;

pub const FEATURE_COMPAT_SB_CHKSUM: u32 = 0x1;
pub const FEATURE_COMPAT_MTIME: u32 = 0x2;
pub const FEATURE_COMPAT_XATTR_FILTER: u32 = 0x4;

/// Incompatible feature: 0-padded compressed data (meaningless without
/// compression; set by some EROFS writers regardless).
pub const FEATURE_INCOMPAT_ZERO_PADDING: u32 = 0x1;
/// Incompatible feature: chunk-based inodes.
pub const FEATURE_INCOMPAT_CHUNKED_FILE: u32 = 0x4;
/// The incompatible features the reader accepts (composefs sets none).
pub const FEATURE_INCOMPAT_KNOWN: u32 = FEATURE_INCOMPAT_ZERO_PADDING | FEATURE_INCOMPAT_CHUNKED_FILE;

/// composefs header field offsets (each a little-endian u32).
pub mod header {
    pub const MAGIC: usize = 0;
    /// Header format version ([`super::COMPOSEFS_HEADER_VERSION`]).
    pub const VERSION: usize = 4;
    pub const FLAGS: usize = 8;
    /// The image's composefs version (0 or 1).
    pub const COMPOSEFS_VERSION: usize = 12;
}

// Superblock field offsets, relative to EROFS_SUPER_OFFSET.
pub mod sb {
    pub const MAGIC: usize = 0;
    pub const CHECKSUM: usize = 4;
    pub const FEATURE_COMPAT: usize = 8;
    pub const BLKSZBITS: usize = 12;
    pub const EXTSLOTS: usize = 13;
    pub const ROOT_NID: usize = 14;
    pub const INOS: usize = 16;
    pub const BUILD_TIME: usize = 24;
    pub const BUILD_TIME_NSEC: usize = 32;
    pub const BLOCKS: usize = 36;
    pub const META_BLKADDR: usize = 40;
    pub const XATTR_BLKADDR: usize = 44;
    pub const UUID: usize = 48;
    pub const VOLUME_NAME: usize = 64;
    pub const FEATURE_INCOMPAT: usize = 80;
}

/// i_format: bit 0 is the layout version (0 compact, 1 extended), bits 1..3
/// the data layout.
pub const I_VERSION_BIT: u16 = 0;
pub const I_DATALAYOUT_BIT: u16 = 1;
pub const LAYOUT_FLAT_PLAIN: u16 = 0;
pub const LAYOUT_COMPRESSED_FULL: u16 = 1;
pub const LAYOUT_FLAT_INLINE: u16 = 2;
pub const LAYOUT_COMPRESSED_COMPACT: u16 = 3;
pub const LAYOUT_CHUNK_BASED: u16 = 4;
/// Mask of the data layout once shifted down by [`I_DATALAYOUT_BIT`].
pub const I_DATALAYOUT_MASK: u16 = 0x7;
/// All defined i_format bits (version and layout); others must be zero.
pub const I_FORMAT_ALL: u16 = 0xf;
pub const CHUNK_FORMAT_BLKBITS_MASK: u16 = 0x1f;
pub const CHUNK_FORMAT_INDEXES: u16 = 0x20;
/// A chunk address that maps nothing (reads as a hole).
pub const NULL_ADDR: u32 = 0xffff_ffff;

pub const INODE_COMPACT_SIZE: usize = 32;
pub const INODE_EXTENDED_SIZE: usize = 64;

// Inode field offsets (compact and extended share the first 24 bytes' roles,
// but not all positions).
pub mod ino {
    pub const FORMAT: usize = 0;
    pub const XATTR_ICOUNT: usize = 2;
    pub const MODE: usize = 4;
    /// compact: nlink (u16); extended: reserved.
    pub const C_NLINK: usize = 6;
    /// compact: u32; extended: u64.
    pub const SIZE: usize = 8;
    /// raw_blkaddr / rdev / chunk format (u16).
    pub const U: usize = 16;
    pub const INO: usize = 20;
    /// compact: u16; extended: u32.
    pub const UID: usize = 24;
    /// compact: u16 at 26; extended: u32 at 28.
    pub const C_GID: usize = 26;
    pub const E_GID: usize = 28;
    pub const E_MTIME: usize = 32;
    pub const E_MTIME_NSEC: usize = 40;
    pub const E_NLINK: usize = 44;
}

/// Xattr body header: name filter (u32), shared count (u8), 7 reserved.
pub const XATTR_IBODY_HEADER_SIZE: usize = 12;
/// Xattr entry header: name_len (u8), name_index (u8), value_size (u16).
pub const XATTR_ENTRY_SIZE: usize = 4;
pub const XATTR_FILTER_BITS: u32 = 32;
pub const XATTR_FILTER_DEFAULT: u32 = u32::MAX;
pub const XATTR_FILTER_SEED: u32 = 0x25BB_E08F;
/// A shared-xattr count at or above this is not allowed in the header.
pub const XATTR_LONG_PREFIX: u8 = 0x80;

pub const XATTR_INDEX_USER: u8 = 1;
pub const XATTR_INDEX_POSIX_ACL_ACCESS: u8 = 2;
pub const XATTR_INDEX_POSIX_ACL_DEFAULT: u8 = 3;
pub const XATTR_INDEX_TRUSTED: u8 = 4;
pub const XATTR_INDEX_LUSTRE: u8 = 5;
pub const XATTR_INDEX_SECURITY: u8 = 6;

/// Prefix of each xattr name index (index 0 means no prefix).
pub const XATTR_PREFIXES: [&[u8]; 7] = [
    b"",
    b"user.",
    b"system.posix_acl_access",
    b"system.posix_acl_default",
    b"trusted.",
    b"lustre.",
    b"security.",
];

/// Prefixes the writer abbreviates, in the order it tries them.
pub const WRITER_XATTR_PREFIXES: [(&[u8], u8); 5] = [
    (b"user.", XATTR_INDEX_USER),
    (b"system.posix_acl_access", XATTR_INDEX_POSIX_ACL_ACCESS),
    (b"system.posix_acl_default", XATTR_INDEX_POSIX_ACL_DEFAULT),
    (b"trusted.", XATTR_INDEX_TRUSTED),
    (b"security.", XATTR_INDEX_SECURITY),
];

/// Splits an xattr name into its EROFS index and the stored suffix.
pub fn xattr_split(key: &[u8]) -> (u8, &[u8]) {
    for (prefix, index) in WRITER_XATTR_PREFIXES {
        if let Some(rest) = key.strip_prefix(prefix) {
            return (index, rest);
        }
    }
    (0, key)
}

/// Bit of the inode's xattr name filter for a (suffix, index) pair; a set
/// bit in the stored filter means "no xattr with such a name".
pub fn xattr_filter_bit(index: u8, suffix: &[u8]) -> u32 {
    xxhash_rust::xxh32::xxh32(suffix, XATTR_FILTER_SEED.wrapping_add(index as u32)) & (XATTR_FILTER_BITS - 1)
}

pub const DIRENT_SIZE: usize = 12;
// Dirent: nid (u64), nameoff (u16), file_type (u8), reserved (u8).
pub const FT_UNKNOWN: u8 = 0;
pub const FT_REG_FILE: u8 = 1;
pub const FT_DIR: u8 = 2;
pub const FT_CHRDEV: u8 = 3;
pub const FT_BLKDEV: u8 = 4;
pub const FT_FIFO: u8 = 5;
pub const FT_SOCK: u8 = 6;
pub const FT_SYMLINK: u8 = 7;

/// The composefs overlay xattrs.
pub mod overlay {
    pub const PREFIX: &[u8] = b"trusted.overlay.";
    pub const ESCAPE_PREFIX: &[u8] = b"trusted.overlay.overlay.";
    pub const METACOPY: &[u8] = b"trusted.overlay.metacopy";
    pub const REDIRECT: &[u8] = b"trusted.overlay.redirect";
    pub const OPAQUE: &[u8] = b"trusted.overlay.opaque";
    pub const ESCAPED_WHITEOUT: &[u8] = b"trusted.overlay.overlay.whiteout";
    pub const ESCAPED_WHITEOUTS: &[u8] = b"trusted.overlay.overlay.whiteouts";
    pub const ESCAPED_OPAQUE: &[u8] = b"trusted.overlay.overlay.opaque";
    pub const USER_WHITEOUT: &[u8] = b"user.overlay.whiteout";
    pub const USER_WHITEOUTS: &[u8] = b"user.overlay.whiteouts";
    pub const USER_OPAQUE: &[u8] = b"user.overlay.opaque";
}

/// Chunk size bits for an external file of `size` bytes: as few chunks as
/// possible, at least one block, at most the format's largest chunk.
pub fn chunk_bits(size: u64) -> u32 {
    let bits = if size <= 1 { 0 } else { 64 - (size - 1).leading_zeros() };
    bits.clamp(BLOCK_BITS, BLOCK_BITS + CHUNK_FORMAT_BLKBITS_MASK as u32)
}

/// Number of chunks for an external file of `size` bytes.
pub fn chunk_count(size: u64) -> u64 {
    let bits = chunk_bits(size);
    size.div_ceil(1u64 << bits)
}

/// The composefs writer keeps chunk indexes of external files within one
/// block, which caps external files at 1024 chunks of 2^43 bytes.
pub const MAX_EXTERNAL_CHUNKS: u64 = 1024;

pub fn get_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

pub fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

pub fn get_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

pub fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking() {
        assert_eq!(chunk_bits(1), 12);
        assert_eq!(chunk_bits(4096), 12);
        assert_eq!(chunk_bits(4097), 13);
        assert_eq!(chunk_count(4097), 1);
        assert_eq!(chunk_bits(1 << 40), 40);
        assert_eq!(chunk_bits(u64::MAX), 43);
        assert_eq!(chunk_count(u64::MAX), 1 << 21);
    }
}
