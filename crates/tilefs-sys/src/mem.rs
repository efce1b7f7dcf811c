//! The C library's heap.

/// Returns the heap's free memory to the system (glibc's malloc_trim, which
/// also releases free pages inside each thread's arena): a process that has
/// just freed many small allocations gives their pages back.
pub fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory no allocation uses; it takes
    // the allocator's own locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Keeps glibc's threshold for giving a large allocation a mapping of its
/// own at `bytes` instead of letting it grow with each such block freed
/// (after which those sizes come from the arenas and stay resident).
pub fn fix_mmap_threshold(bytes: usize) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes a parameter of the allocator, under its
    // own lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, bytes.min(i32::MAX as usize) as libc::c_int);
    }
}
