//! Twin tests: every ISA's copy gives `copy_from_slice`'s bytes for every length and alignment,
//! and writes nothing outside its destination.

use super::*;
use crate::testutil::bytes;

fn every_isa() -> Vec<(Isa, Fns)> {
    // SAFETY: only the ISAs this host has.
    Isa::available().into_iter().map(|isa| (isa, unsafe { Fns::for_isa(isa) })).collect()
}

/// Lengths around the loops' boundaries: below a line, a step, and a few steps, plus one large.
fn lengths() -> Vec<usize> {
    let mut out: Vec<usize> = (0..=3 * STEP + 2 * LINE).collect();
    for base in [4096, 1 << 20] {
        out.extend(base - 70..base + 70);
    }
    out.push(3 * (1 << 20) + 12_345);
    out
}

#[test]
fn every_isa_copies_every_length_at_every_alignment_and_nothing_else() {
    const GUARD: usize = 2 * LINE;
    let src = bytes(3 * (1 << 20) + 12_345 + LINE, 1);
    let mut dst = vec![0u8; src.len() + 2 * GUARD + LINE];
    for (isa, fns) in every_isa() {
        for len in lengths() {
            // Destination offsets within a line and source offsets that differ from them.
            for (d, s) in [(0, 0), (1, 0), (0, 5), (LINE - 1, 3), (17, 17)] {
                let base = GUARD + dst[GUARD..].as_ptr().align_offset(LINE) + d;
                let window = base - GUARD..base + len + GUARD;
                dst[window.clone()].fill(0xA5);
                fns.copy(&mut dst[base..base + len], &src[s..s + len]);
                assert!(dst[base..base + len] == src[s..s + len], "{isa}: {len} bytes at dst+{d}, src+{s}");
                assert!(
                    dst[window.start..base].iter().all(|&b| b == 0xA5),
                    "{isa}: wrote before dst ({len} bytes, +{d})"
                );
                assert!(
                    dst[base + len..window.end].iter().all(|&b| b == 0xA5),
                    "{isa}: wrote past dst ({len} bytes, +{d})"
                );
            }
        }
    }
}

#[test]
fn every_copy_of_a_step_past_the_first_line_boundary_streams() {
    for addr in 0..3 * LINE {
        for len in 0..4 * STEP {
            let (head, body) = split(addr, len);
            assert!(head < LINE && head <= len, "{addr} + {len}: head {head}");
            assert!(head == len || (addr + head).is_multiple_of(LINE), "{addr} + {len}: head {head} stops short");
            assert!(body.is_multiple_of(STEP) && head + body <= len && len - head - body < STEP);
            if len >= head + STEP {
                assert!(body > 0 && (addr + head).is_multiple_of(LINE), "{addr} + {len}: no streamed body");
            }
        }
    }
    assert_eq!(split(64, 1000), (0, 768));
    assert_eq!(split(65, 1000), (63, 768));
    assert_eq!(split(100, 10), (10, 0));
}

#[test]
fn the_best_isa_copies_too() {
    let src = bytes(1 << 20, 2);
    let mut dst = vec![0u8; src.len()];
    copy_streaming(&mut dst, &src);
    assert!(dst == src);
}

#[test]
#[should_panic(expected = "copy: 10 bytes into 9")]
fn lengths_that_differ_are_refused() {
    let src = [0u8; 10];
    let mut dst = [0u8; 9];
    copy_streaming(&mut dst, &src);
}
