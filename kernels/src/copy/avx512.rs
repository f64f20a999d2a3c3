//! The AVX-512 streaming copy: four 64-byte lines per step.

use std::arch::x86_64::{_mm512_loadu_si512, _mm512_stream_si512, _mm_sfence};

use super::{LINE, STEP};

/// # Safety
/// AVX-512 F must be available; `src..src + len` readable, `dst..dst + len` writable and not
/// overlapping it, `dst` aligned to [`LINE`], `len` a multiple of [`STEP`].
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn stream(dst: *mut u8, src: *const u8, len: usize) {
    debug_assert!(dst.addr().is_multiple_of(LINE) && len.is_multiple_of(STEP));
    let mut at = 0;
    while at < len {
        // SAFETY: at + STEP <= len (len is a multiple of STEP), so the four lines from `at` lie in
        // both ranges (the contract); the loads are unaligned, the stores aligned since `dst` and
        // `at` are multiples of LINE.
        unsafe {
            let lines = [0, 1, 2, 3].map(|i| _mm512_loadu_si512(src.add(at + i * LINE).cast()));
            for (i, line) in lines.into_iter().enumerate() {
                _mm512_stream_si512(dst.add(at + i * LINE).cast(), line);
            }
        }
        at += STEP;
    }
    // Streaming stores are weakly ordered: fence them before the caller's next store.
    _mm_sfence();
}
