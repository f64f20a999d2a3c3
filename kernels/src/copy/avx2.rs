//! The AVX2 streaming copy: four 64-byte lines per step, each as two 32-byte halves.

use std::arch::x86_64::{_mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};

use super::{LINE, STEP};

/// # Safety
/// AVX2 must be available; `src..src + len` readable, `dst..dst + len` writable and not
/// overlapping it, `dst` aligned to [`LINE`], `len` a multiple of [`STEP`].
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn stream(dst: *mut u8, src: *const u8, len: usize) {
    debug_assert!(dst.addr().is_multiple_of(LINE) && len.is_multiple_of(STEP));
    const HALF: usize = LINE / 2;
    let mut at = 0;
    while at < len {
        // SAFETY: at + STEP <= len (len is a multiple of STEP), so the eight halves from `at` lie
        // in both ranges (the contract); the loads are unaligned, the stores aligned to 32 bytes
        // since `dst` and `at` are multiples of LINE and each `i * HALF` a multiple of 32.
        unsafe {
            let halves = [0, 1, 2, 3, 4, 5, 6, 7].map(|i| _mm256_loadu_si256(src.add(at + i * HALF).cast()));
            for (i, half) in halves.into_iter().enumerate() {
                _mm256_stream_si256(dst.add(at + i * HALF).cast(), half);
            }
        }
        at += STEP;
    }
    // Streaming stores are weakly ordered: fence them before the caller's next store.
    _mm_sfence();
}
