//! AVX-512 probe used to validate the Bochs harness (tools/avx512-bochs).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Which AVX-512 subsets the running CPU + OS expose.
pub fn features() -> Vec<(&'static str, bool)> {
    vec![
        ("avx2", is_x86_feature_detected!("avx2")),
        ("fma", is_x86_feature_detected!("fma")),
        ("avx512f", is_x86_feature_detected!("avx512f")),
        ("avx512bw", is_x86_feature_detected!("avx512bw")),
        ("avx512vl", is_x86_feature_detected!("avx512vl")),
        ("avx512dq", is_x86_feature_detected!("avx512dq")),
        ("avx512cd", is_x86_feature_detected!("avx512cd")),
        ("avx512vnni", is_x86_feature_detected!("avx512vnni")),
        ("avx512vbmi", is_x86_feature_detected!("avx512vbmi")),
    ]
}

pub fn required_detected() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq")
}

/// Runs a handful of AVX-512 instructions and compares with scalar code.
/// Returns a list of (check name, ok).
///
/// # Safety
/// Caller must ensure avx512f/bw/vl/dq are available (otherwise SIGILL).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
pub unsafe fn avx512_checks() -> Vec<(&'static str, bool)> {
    let mut out = Vec::new();

    // 1. FMA on 16 f32 lanes.
    let a: [f32; 16] = core::array::from_fn(|i| i as f32 * 0.5 - 3.0);
    let b: [f32; 16] = core::array::from_fn(|i| 1.25 + i as f32);
    let c: [f32; 16] = core::array::from_fn(|i| 100.0 - (i * i) as f32);
    let r = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr()), _mm512_loadu_ps(b.as_ptr()), _mm512_loadu_ps(c.as_ptr()));
    let mut got = [0f32; 16];
    _mm512_storeu_ps(got.as_mut_ptr(), r);
    let want: [f32; 16] = core::array::from_fn(|i| a[i].mul_add(b[i], c[i]));
    out.push(("_mm512_fmadd_ps", got == want));

    // 2. Sign-extend 16 x i8 -> 16 x i32 (AVX512F).
    let bytes: [i8; 16] = [-128, -7, -1, 0, 1, 2, 3, 127, 50, -50, 9, -9, 64, -64, 100, -100];
    let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(bytes.as_ptr() as *const __m128i));
    let mut got_i = [0i32; 16];
    _mm512_storeu_si512(got_i.as_mut_ptr() as *mut _, v);
    let want_i: [i32; 16] = core::array::from_fn(|i| bytes[i] as i32);
    out.push(("_mm512_cvtepi8_epi32", got_i == want_i));

    // 3. Full-width permute.
    let idx: [i32; 16] = core::array::from_fn(|i| ((i * 7 + 3) % 16) as i32);
    let p = _mm512_permutexvar_ps(_mm512_loadu_si512(idx.as_ptr() as *const _), _mm512_loadu_ps(a.as_ptr()));
    _mm512_storeu_ps(got.as_mut_ptr(), p);
    let want_p: [f32; 16] = core::array::from_fn(|i| a[idx[i] as usize]);
    out.push(("_mm512_permutexvar_ps", got == want_p));

    // 4. Masked load (tail handling): only the first 5 lanes are read.
    let tail = [1.0f32, 2.0, 3.0, 4.0, 5.0];
    let m: __mmask16 = (1u16 << tail.len()) - 1;
    let t = _mm512_maskz_loadu_ps(m, tail.as_ptr());
    let sum = _mm512_reduce_add_ps(t);
    out.push(("_mm512_maskz_loadu_ps+reduce", sum == 15.0));

    // 5. AVX512BW: 64 x u8 saturating add + byte compare into a 64-bit mask.
    let xs: [u8; 64] = core::array::from_fn(|i| (i * 5) as u8);
    let ys: [u8; 64] = core::array::from_fn(|i| (200 - i) as u8);
    let s = _mm512_adds_epu8(_mm512_loadu_si512(xs.as_ptr() as *const _), _mm512_loadu_si512(ys.as_ptr() as *const _));
    let mut got_b = [0u8; 64];
    _mm512_storeu_si512(got_b.as_mut_ptr() as *mut _, s);
    let want_b: [u8; 64] = core::array::from_fn(|i| xs[i].saturating_add(ys[i]));
    let k = _mm512_cmpeq_epi8_mask(s, _mm512_set1_epi8(-1));
    let want_k = want_b.iter().enumerate().fold(0u64, |acc, (i, &x)| acc | (((x == 255) as u64) << i));
    out.push(("_mm512_adds_epu8+cmpeq_mask (BW)", got_b == want_b && k == want_k));

    // 6. AVX512VL: masked 256-bit op; AVX512DQ: 64-bit multiply.
    let y = _mm256_mask_add_ps(_mm256_set1_ps(-1.0), 0b1010_1010, _mm256_set1_ps(2.0), _mm256_set1_ps(3.0));
    let mut got8 = [0f32; 8];
    _mm256_storeu_ps(got8.as_mut_ptr(), y);
    let want8: [f32; 8] = core::array::from_fn(|i| if i % 2 == 1 { 5.0 } else { -1.0 });
    let q = _mm512_mullo_epi64(_mm512_set1_epi64(0x1_0000_0003), _mm512_set1_epi64(0x7));
    let mut got_q = [0i64; 8];
    _mm512_storeu_si512(got_q.as_mut_ptr() as *mut _, q);
    out.push(("_mm256_mask_add_ps (VL) + _mm512_mullo_epi64 (DQ)", got8 == want8 && got_q == [0x7_0000_0015i64; 8]));

    out
}

/// Runs the checks on a spawned thread too (exercises clone + XSAVE state on context switch).
pub fn run_all(verbose: bool) -> bool {
    let mut ok = true;
    for (name, det) in features() {
        if verbose {
            println!("feature {name:<10} {}", if det { "detected" } else { "NOT detected" });
        }
    }
    if !required_detected() {
        println!("FAIL: avx512f/bw/vl/dq not all detected");
        return false;
    }
    let main_res = unsafe { avx512_checks() };
    let thread_res = std::thread::spawn(|| unsafe { avx512_checks() }).join().expect("thread panicked");
    for ((name, a), (_, b)) in main_res.iter().zip(thread_res.iter()) {
        if verbose {
            println!("check {name:<50} main={} thread={}", if *a { "ok" } else { "FAIL" }, if *b { "ok" } else { "FAIL" });
        }
        ok &= *a && *b;
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avx512_features_detected() {
        assert!(required_detected(), "{:?}", features());
    }

    #[test]
    fn avx512_intrinsics_match_scalar() {
        assert!(run_all(true));
    }

    #[test]
    fn scalar_sanity() {
        assert_eq!(2 + 2, 4);
    }
}
