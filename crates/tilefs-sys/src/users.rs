//! The system's user and group databases.

/// The uid of the user `name`.
pub fn uid_of(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: getpwnam_r writes into `pwd` and `buf` (of the given length)
    // only, and sets `out` to &pwd or null; nothing is kept after return.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        let r = libc::getpwnam_r(c.as_ptr(), &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut out);
        (r == 0 && !out.is_null()).then_some(pwd.pw_uid)
    }
}

/// The gid of the group `name`.
pub fn gid_of(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: as in uid_of, for getgrnam_r.
    unsafe {
        let mut grp: libc::group = std::mem::zeroed();
        let mut out: *mut libc::group = std::ptr::null_mut();
        let r = libc::getgrnam_r(c.as_ptr(), &mut grp, buf.as_mut_ptr().cast(), buf.len(), &mut out);
        (r == 0 && !out.is_null()).then_some(grp.gr_gid)
    }
}
