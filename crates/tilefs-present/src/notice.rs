//! What the user should know about how an image was presented: one line
//! each, in the library's words (front ends print them their own way).

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// A lazily pulled image is served by FUSE, which fetches.
    FuseFetches { absent: usize, total: usize, why: String },
    /// Verification is required and only FUSE can do it here.
    FuseVerifies(String),
    /// No kernel mount here: served by FUSE.
    NoKernel(String),
    /// The mount service did not mount it (unreachable, or refused):
    /// served by FUSE.
    ServiceDeclined { no_kernel: String, why: String },
    /// Made by the mount service (a kernel mount).
    ByService,
    /// Something the kernel mount or the service said.
    Mount(String),
    /// A writable mount of an image owned by root, by another user: root's
    /// files are shown as the user's (the ids stored stay 0).
    FakeRoot { uid: u32, gid: u32 },
    /// The mount point was not empty: what is there is hidden while the
    /// image is mounted over it.
    Covers(std::path::PathBuf),
    /// The mount is not recorded in its store: gc there may remove the
    /// objects it uses.
    NotRecorded(String),
}

impl Notice {
    /// Whether the notice states a fact of the machine or of its set-up,
    /// the same on every mount (no kernel mount, no mount service, no
    /// fs-verity): front ends may say it once. FUSE chosen because
    /// verification was required answers the request: said each time.
    pub fn is_machine_fact(&self) -> bool {
        matches!(
            self,
            Notice::NoKernel(_) | Notice::ServiceDeclined { .. } | Notice::Mount(_)
        )
    }
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::FuseFetches { absent, total, why } => write!(
                f,
                "using the FUSE mount: {absent} of the image's {total} objects are still to be fetched \
                 (pulled lazily), and the kernel cannot fill them here: {why}"
            ),
            Notice::FuseVerifies(why) => write!(f, "using the FUSE mount, which verifies objects itself: {why}"),
            Notice::NoKernel(why) => write!(f, "using the FUSE mount: no kernel mount here ({why})"),
            Notice::ServiceDeclined { no_kernel, why } => {
                write!(f, "using the FUSE mount: no kernel mount here ({no_kernel}; {why})")
            }
            Notice::ByService => write!(f, "mounted by the mount service (a kernel mount)"),
            Notice::Mount(n) => f.write_str(n),
            Notice::FakeRoot { uid, gid } => write!(
                f,
                "the image belongs to root: its root-owned files are shown as yours and what you \
                 create is stored as root's (uidmapping=0:{uid}:1,gidmapping=0:{gid}:1; give -o \
                 uidmapping=/gidmapping= to choose otherwise)"
            ),
            Notice::Covers(p) => write!(
                f,
                "{} is not empty: its files are hidden until the image is unmounted",
                p.display()
            ),
            Notice::NotRecorded(e) => write!(
                f,
                "the mount is not recorded in the store, so gc there may remove its objects: {e}"
            ),
        }
    }
}
