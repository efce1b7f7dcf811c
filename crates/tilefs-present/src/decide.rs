//! The decision: how to present an image, from the request and what the
//! machine offers. Pure: everything it looks at is in [`Machine`], so
//! every front end decides alike and the table is tested as a table.

use crate::notice::Notice;
use tilefs_mount::options::Backend;
use tilefs_store::Verity;

/// Whether this process may make kernel mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelAccess {
    /// EROFS and overlayfs are there and ours to mount.
    Yes,
    /// They are there but not for us (no privilege, a user namespace):
    /// the mount service may mount for us.
    NotPermitted(String),
    /// Not on this machine.
    Unavailable(String),
}

/// What the machine offers for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// The store can be opened by this user (else only the mount service,
    /// which reads it as root, can mount its images).
    pub store_readable: bool,
    /// The image was pulled lazily and the store still lacks objects:
    /// `(absent, total)`.
    pub lazy: Option<(usize, usize)>,
    /// For a lazy image: why the kernel cannot serve it, filling objects
    /// as they are first read (None: it can; see `kernel_lazy`).
    pub no_lazy_kernel: Option<String>,
    pub kernel: KernelAccess,
    /// Why the kernel cannot verify objects, if it cannot (no fs-verity).
    pub kernel_cannot_verify: Option<String>,
}

/// The ways to try, in order: the first that works presents the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Kernel,
    /// A kernel mount of a lazily pulled image whose objects not fetched
    /// yet are placeholders that a filler fills on first access.
    KernelLazy,
    Delegated,
    Fuse,
    /// The mount service; if it will not, FUSE (saying why the kernel was
    /// not used).
    DelegatedElseFuse {
        no_kernel: String,
    },
}

/// What [`decide`] chose, and what the user should be told about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub plan: Plan,
    pub notices: Vec<Notice>,
    /// Why the kernel was not used, for the message if FUSE then fails.
    pub no_kernel: Option<String>,
}

/// Why no way can present the image as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the image was pulled lazily and {absent} of its {total} objects are not fetched yet: only a FUSE mount fetches them here ({why})")]
    LazyNeedsFuse { absent: usize, total: usize, why: String },
}

/// Decides how to present an image: as `backend` says when it says
/// (`None`: choose), with `verity`, on a machine that offers `m`.
pub fn decide(backend: Option<Backend>, verity: Verity, m: &Machine) -> Result<Decision, Refusal> {
    let decision = |plan, notices, no_kernel| Decision {
        plan,
        notices,
        no_kernel,
    };
    // A store this user may not read: only the service reads it.
    if !m.store_readable && matches!(backend, None | Some(Backend::Delegated)) {
        return Ok(decision(Plan::Delegated, Vec::new(), None));
    }
    // A lazy image: the kernel where it can fill placeholders, else FUSE.
    let lazy_refused = |why: String| {
        let (absent, total) = m.lazy.unwrap_or_default();
        Refusal::LazyNeedsFuse { absent, total, why }
    };
    let no_lazy_kernel = match (&m.kernel, &m.no_lazy_kernel, &m.kernel_cannot_verify, verity) {
        (KernelAccess::NotPermitted(why) | KernelAccess::Unavailable(why), ..) => Some(why.clone()),
        (_, Some(why), ..) => Some(why.clone()),
        (_, None, Some(why), Verity::Require) => Some(why.clone()),
        // overlayfs checks a file's fs-verity when it is opened, before the
        // open reaches the store (and so the filler): every placeholder
        // would fail. Filled objects get fs-verity; once the image is
        // complete the kernel mounts it requiring it.
        (_, None, None, Verity::Require) => Some(
            "verity=require: overlayfs checks fs-verity before a first open reaches the filler, \
             and no placeholder has it"
                .into(),
        ),
        _ => None,
    };
    Ok(match (backend, m.lazy) {
        (Some(Backend::Delegated), Some(_)) => {
            return Err(lazy_refused(
                "the mount service does not mount lazily pulled images".into(),
            ))
        }
        (Some(Backend::Kernel), Some(_)) => match no_lazy_kernel {
            None => decision(Plan::KernelLazy, Vec::new(), None),
            Some(why) => return Err(lazy_refused(why)),
        },
        (Some(Backend::Kernel), _) => decision(Plan::Kernel, Vec::new(), None),
        (Some(Backend::Delegated), _) => decision(Plan::Delegated, Vec::new(), None),
        (Some(Backend::Fuse), _) => decision(Plan::Fuse, Vec::new(), None),
        (None, Some((absent, total))) => match no_lazy_kernel {
            None => decision(Plan::KernelLazy, Vec::new(), None),
            Some(why) => decision(Plan::Fuse, vec![Notice::FuseFetches { absent, total, why }], None),
        },
        (None, None) => match &m.kernel {
            KernelAccess::NotPermitted(why) => decision(
                Plan::DelegatedElseFuse { no_kernel: why.clone() },
                Vec::new(),
                Some(why.clone()),
            ),
            KernelAccess::Yes => match (&m.kernel_cannot_verify, verity) {
                (Some(why), Verity::Require) => decision(Plan::Fuse, vec![Notice::FuseVerifies(why.clone())], None),
                _ => decision(Plan::Kernel, Vec::new(), None),
            },
            KernelAccess::Unavailable(why) => {
                decision(Plan::Fuse, vec![Notice::NoKernel(why.clone())], Some(why.clone()))
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Machine {
        Machine {
            store_readable: true,
            lazy: None,
            no_lazy_kernel: None,
            kernel: KernelAccess::Yes,
            kernel_cannot_verify: None,
        }
    }

    #[test]
    fn the_table() {
        use Backend::*;
        let m = machine();
        let plan = |b, v, m: &Machine| decide(b, v, m).map(|d| d.plan);
        // Asked for: as asked.
        for (b, p) in [(Kernel, Plan::Kernel), (Fuse, Plan::Fuse), (Delegated, Plan::Delegated)] {
            assert_eq!(plan(Some(b), Verity::Auto, &m), Ok(p));
        }
        // Chosen: the kernel where it can...
        assert_eq!(plan(None, Verity::Auto, &m), Ok(Plan::Kernel));
        // ... unless verification is required and it cannot verify.
        let noverity = Machine {
            kernel_cannot_verify: Some("no fs-verity".into()),
            ..machine()
        };
        assert_eq!(plan(None, Verity::Auto, &noverity), Ok(Plan::Kernel));
        let d = decide(None, Verity::Require, &noverity).unwrap();
        assert_eq!(d.plan, Plan::Fuse);
        assert_eq!(d.notices, vec![Notice::FuseVerifies("no fs-verity".into())]);
        // Without privilege: the service, else FUSE.
        let user = Machine {
            kernel: KernelAccess::NotPermitted("no privilege".into()),
            ..machine()
        };
        assert_eq!(
            plan(None, Verity::Auto, &user),
            Ok(Plan::DelegatedElseFuse {
                no_kernel: "no privilege".into()
            })
        );
        // No kernel at all: FUSE, saying why.
        let none = Machine {
            kernel: KernelAccess::Unavailable("no erofs".into()),
            ..machine()
        };
        let d = decide(None, Verity::Auto, &none).unwrap();
        assert_eq!((d.plan, d.no_kernel.as_deref()), (Plan::Fuse, Some("no erofs")));
        // A lazy image: the kernel filling placeholders where it can...
        let lazy = Machine {
            lazy: Some((3, 10)),
            ..machine()
        };
        assert_eq!(plan(None, Verity::Auto, &lazy), Ok(Plan::KernelLazy));
        assert_eq!(plan(Some(Kernel), Verity::Auto, &lazy), Ok(Plan::KernelLazy));
        assert!(plan(Some(Delegated), Verity::Auto, &lazy).is_err());
        assert_eq!(plan(Some(Fuse), Verity::Auto, &lazy), Ok(Plan::Fuse));
        // verity=require of an incomplete image: FUSE verifies what arrives.
        assert_eq!(plan(None, Verity::Require, &lazy), Ok(Plan::Fuse));
        assert!(plan(Some(Kernel), Verity::Require, &lazy).is_err());
        // ... else FUSE, saying why once.
        let tmpfs = Machine {
            no_lazy_kernel: Some("no marks on tmpfs".into()),
            ..lazy.clone()
        };
        let d = decide(None, Verity::Auto, &tmpfs).unwrap();
        assert_eq!(d.plan, Plan::Fuse);
        assert_eq!(
            d.notices,
            vec![Notice::FuseFetches {
                absent: 3,
                total: 10,
                why: "no marks on tmpfs".into()
            }]
        );
        assert!(plan(Some(Kernel), Verity::Auto, &tmpfs).is_err());
        let user_lazy = Machine {
            kernel: KernelAccess::NotPermitted("no privilege".into()),
            ..lazy.clone()
        };
        assert_eq!(plan(None, Verity::Auto, &user_lazy), Ok(Plan::Fuse));
        let lazy_noverity = Machine {
            kernel_cannot_verify: Some("no fs-verity".into()),
            ..lazy.clone()
        };
        assert_eq!(plan(None, Verity::Require, &lazy_noverity), Ok(Plan::Fuse));
        // A store we cannot read: the service.
        let unreadable = Machine {
            store_readable: false,
            ..user
        };
        assert_eq!(plan(None, Verity::Auto, &unreadable), Ok(Plan::Delegated));
        assert_eq!(plan(Some(Fuse), Verity::Auto, &unreadable), Ok(Plan::Fuse));
    }
}
