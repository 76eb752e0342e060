//! The allocator's settings, for the binaries that use mimalloc (feature `mimalloc`).

/// Tells mimalloc never to return freed memory to the operating system. By default it
/// "purges" memory unused for 10 ms; a training step frees and allocates the same large
/// buffers every few milliseconds, and after each purge the kernel zeroes fresh pages
/// again when they are touched (in a profile of training steps at the reference size,
/// about 8% of the cycles were the kernel clearing pages). The process keeps its peak
/// memory instead. Does nothing without the feature.
pub fn keep_freed_memory() {
    #[cfg(feature = "mimalloc")]
    // SAFETY: mimalloc's documented C API; setting an option is valid at any time.
    unsafe {
        mi_option_set(MI_OPTION_PURGE_DELAY, -1);
    }
}

/// `mi_option_purge_delay` in `mimalloc.h` (the v2 sources the `mimalloc` crate builds):
/// milliseconds before freed memory is purged, -1 for never.
#[cfg(feature = "mimalloc")]
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

#[cfg(feature = "mimalloc")]
unsafe extern "C" {
    /// mimalloc's `void mi_option_set(mi_option_t option, long value)`.
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}
