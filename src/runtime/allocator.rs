//! The host allocator's policy for a training process.
//!
//! glibc's `malloc` serves each buffer above its mmap threshold (adaptive, from 128 KiB) with
//! its own mapping and gives it back to the kernel when freed, and it trims the heap's free top
//! above 128 KiB; a training step frees and allocates the same large activations and gradients
//! every step, so each step faults fresh zeroed pages in again. Fixing the threshold at 32 MiB
//! (glibc's largest) and trimming only above 1 GiB keeps those buffers for reuse: on the Llama
//! bench model (one process, 1 thread) 9 % less CPU time per step, at the same peak memory.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
unsafe extern "C" {
    fn mallopt(param: i32, value: i32) -> i32;
}

/// glibc's `M_TRIM_THRESHOLD` and `M_MMAP_THRESHOLD` (malloc.h).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const M_TRIM_THRESHOLD: i32 = -1;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const M_MMAP_THRESHOLD: i32 = -3;

/// Keeps freed tensor buffers in the process for the next step (see the module docs); a
/// no-op where the C library is not glibc. Returns whether both settings took.
pub fn keep_freed_buffers() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets allocator parameters; called before the run allocates.
        unsafe { mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
