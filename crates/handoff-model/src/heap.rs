//! Handing freed heap memory back to the system.

/// Return the heap's free memory to the system where the allocator keeps it
/// (glibc keeps freed blocks below its adaptive mmap threshold, up to 32
/// MiB each, in its arenas): after a load has converted a model's weights,
/// written them to the weight cache and dropped them, this is the
/// difference between the process holding them (anonymous, resident) and
/// not.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it
    // takes no pointer and is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
