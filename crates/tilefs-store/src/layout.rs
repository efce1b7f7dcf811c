//! The store on disk, whole: every name under `STORE/`, who writes it, and
//! what a crash leaves. The names are defined here and nowhere else; the
//! modules that own each part say how it is read and written.
//!
//! Writers make a file whole before it has its name (written in `.tmp/` or
//! beside it, then renamed), so a crash leaves either the old file or the
//! new one, plus a leftover in `.tmp/` that `gc` removes. Objects and
//! images are also synced before the rename ("durable before visible");
//! bookkeeping that can be rebuilt is not.
//!
//! | Name | What | Written by | After a crash |
//! |------|------|------------|---------------|
//! | `XX/YYYY…` | objects, named by the fs-verity SHA-256 digest of their contents in hex, split after two digits, exactly as a composefs digest store lays them out (mode 0644) | [`crate::ingest`] (builds, pulls), fetches of lazy images | whole or absent: synced, then renamed from `.tmp/` |
//! | `XX/YYYY…` of mode 01000 | placeholders: objects not fetched yet, sparse, of their size | [`crate::placeholder`] (kernel lazy mounts); filled in place | a fill cut short leaves a placeholder, never an object with holes |
//! | `images/NAME` | tagged images: the user's gc roots | [`crate::tags`] | whole or absent (renamed from `.tmp/`) |
//! | `.owned/OWNER/NAME`, `.owned/OWNER/.owner` | images a tilefs component holds (gc roots the user does not remove), and who holds them | [`crate::owned`] (the snapshotter) | as tags; `.owner` is written first |
//! | `.mounts/` | a record (and a copy of the image) per live mount: gc roots while the mount lives | [`crate::mounts`] (`mount`, the FUSE server, the mount service) | not synced: no mount outlives a crash, and gc drops records whose mount is gone |
//! | `.remote/DIGEST` | images pulled lazily: where their objects come from (the OCI crate's record; the store only knows it exists) | [`crate::remote`], `tilefs pull --lazy` | an image without its record is complete or refused by fsck; a record without its image is dropped by gc |
//! | `.placeholders/DIGEST` | the index of placeholders (a second link to each), for listings that read names only | [`crate::placeholder`] | written before the placeholder appears and swept after it is filled; the mode decides where the two disagree |
//! | `.placeholders/.filling` | the lock every kernel lazy mount's holder holds shared while it serves (`flock`): fills elsewhere leave its placeholders to it | tilefs-present's `kernel_lazy` | a lock: the kernel drops it with its holder |
//! | `.sha256/XX/…` | objects again, by the SHA-256 of their contents (hardlinks), for images pulled lazily from eStargz and zstd:chunked tables of contents | [`crate::alias`] | a link made only after its object is stored and checked |
//! | `.layers/ALG-HEX`, `.layers/image-KEY` | what a pull learnt of each layer, and the image a list of layers makes (a cache) | tilefs-oci's `layer_cache` | renamed into place; a record that is unreadable, of another version or naming an absent object is not used |
//! | `.trust/DIGEST.json` | the signature policy checks an image passed when it was pulled | tilefs-trust's `evidence` | replaced atomically (synced, renamed, directory synced) |
//! | `.tmp/` | objects, images and records being written | every writer | leftovers of an interrupted write, removed by `gc` |
//! | `.lock` | the store lock: builds hold it shared, `gc` exclusive | [`crate::store`] | a lock (`flock`) |
//! | `.fetch-lock` | fetches lock a byte range of it per object they bring | [`crate::fetch_lock`] | locks only (open-file-description locks) |
//! | `.quarantine/` | objects `fsck --repair` moved aside | [`crate::fsck`] | kept until the user removes them |
//! | `.digest-cache` | digests of source files already imported | [`crate::ingest`] | a cache: one that cannot be read is rebuilt |
//! | `.no-verity-noted` | the user was told the store's filesystem has no fs-verity (said once per store) | [`crate::ingest`] | a marker |
//!
//! Anything else at the top of a store is a stray (fsck says so), except
//! names starting with `.tmp`: temporary objects of the reference tools.

/// Tagged images.
pub const IMAGES_DIR: &str = "images";
/// Files being written; leftovers of interrupted writes.
pub const TMP_DIR: &str = ".tmp";
/// The store lock.
pub const LOCK_FILE: &str = ".lock";
/// Objects `fsck --repair` moved aside.
pub const QUARANTINE_DIR: &str = ".quarantine";
/// Digests of source files already imported.
pub const DIGEST_CACHE: &str = ".digest-cache";
/// The no-fs-verity notice was given.
pub const NO_VERITY_NOTED: &str = ".no-verity-noted";
/// What pulls learnt of each layer they read (so a layer read once is not
/// read again while its objects are present).
pub const LAYER_CACHE: &str = ".layers";
/// Records of the signature policy checks images passed when they were
/// pulled (tilefs-trust's `evidence`), named by the image's fs-verity digest.
pub const TRUST_DIR: &str = ".trust";
/// Records of images pulled lazily.
pub const REMOTE_DIR: &str = ".remote";
/// Objects by the SHA-256 of their contents.
pub const ALIAS_DIR: &str = ".sha256";
/// Records of live mounts.
pub const MOUNTS_DIR: &str = ".mounts";
/// Images tilefs components hold.
pub const OWNED_DIR: &str = ".owned";
/// A holder's record, in its directory under [`OWNED_DIR`] (no image is
/// named so: names of images never start with '.').
pub const OWNER_FILE: &str = ".owner";
/// The index of placeholders.
pub const PLACEHOLDER_DIR: &str = ".placeholders";
/// The lock file fetches lock ranges of.
pub const FETCH_LOCK: &str = ".fetch-lock";

/// Every name at the top of a store other than the objects' fan-out
/// directories.
pub const BOOKKEEPING: [&str; 14] = [
    IMAGES_DIR,
    TMP_DIR,
    LOCK_FILE,
    QUARANTINE_DIR,
    DIGEST_CACHE,
    NO_VERITY_NOTED,
    LAYER_CACHE,
    TRUST_DIR,
    REMOTE_DIR,
    ALIAS_DIR,
    MOUNTS_DIR,
    OWNED_DIR,
    PLACEHOLDER_DIR,
    FETCH_LOCK,
];

/// A name for a temporary file (in [`TMP_DIR`]), unique in this process
/// and (with the pid and the time) across processes, even one whose pid a
/// crashed one had.
pub fn temp_name(prefix: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}{}-{nanos:09}-{n}", std::process::id())
}
