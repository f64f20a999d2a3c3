//! Deterministic CPU kernels for k3ring, the Kimi K3 inference engine, and the checksum its reads
//! are checked with.
//!
//! Every kernel has a scalar version, which is its definition, and an AVX2+FMA version chosen
//! at run time ([`Kernels::detect`], [`Kernels::with_isa`]); the bf16 and MXFP4 matmuls also
//! have an AVX-512 (F + BW + VL) version. **All give identical bits**
//! (`f32::to_bits` equality, no tolerance) for every input: ±0, subnormals, infinities, lengths
//! that are not a multiple of the vector width, unaligned weight bytes. The one exception is the
//! payload (and sign) of a NaN *result*: where a NaN comes out of arithmetic on several NaN
//! operands, which payload wins depends on the instruction's operand order, which the compiler
//! may commute; a NaN result is NaN on every ISA, but its bits are not promised. Results never
//! depend on the thread count: threads split output rows (or heads, in the model), never a
//! reduction. Every ISA follows the same canonical orders below.
//!
//! # Canonical dot
//!
//! Every reduction (bf16 and MXFP4 matmul rows, [`Kernels::dot`], [`Kernels::sum_squares`],
//! RMSNorm's mean square, softmax's sum) is this, with f32 accumulators:
//!
//! 1. 16 lane accumulators `acc[0..16]` start at +0.0.
//! 2. For `i` in increasing order, element `i` updates lane `i % 16`:
//!    `acc[l] = fma(a_i, b_i, acc[l])`, one rounding (`f32::mul_add` in scalar code,
//!    `vfmadd` in SIMD).
//! 3. The length is zero-padded to a multiple of 16, and the padding is processed too:
//!    `fma(0, 0, acc)` turns a `-0.0` lane into `+0.0`.
//! 4. A fixed tree: for `w` in `[8, 4, 2, 1]`, `acc[l] = acc[l] + acc[l + w]` for `l < w`.
//!    The result is `acc[0]`.
//!
//! AVX2 holds lanes 0-7 and 8-15 in two ymm registers; the tree's first step adds the two
//! registers, the next the two 128-bit halves, and so on. AVX-512 holds all 16 lanes in one
//! zmm register, whose two 256-bit halves are that same pair. Softmax's sum uses adds instead
//! of `fma(e, 1, acc)`, which is the same rounding.
//!
//! # Other orders
//!
//! Transposed products ([`Kernels::matvec_t_bf16`]) and the KDA step ([`Kernels::kda_step`])
//! reduce sequentially along the row index with FMA, vectorised across columns, so they need no
//! horizontal reduction. Elementwise functions ([`math`]) use this crate's own `exp` and IEEE
//! `+ - * / sqrt` only, in the operation order written in each kernel's docs.
//!
//! # Layout
//!
//! `src/<op>/{mod.rs, scalar.rs, avx2.rs[, avx512.rs]}`: `mod.rs` holds the contract, shape
//! checks and the dispatch; `scalar.rs` is the definition; `avx2.rs` and `avx512.rs` hold
//! `#[target_feature]` functions, reached only through a [`Kernels`] built after detection (the
//! checksum [`hash`] also through its free functions, which detect once per process; a hash is
//! integer arithmetic, so its ISAs agree with the reference by construction and by test).
//! This machine class has no AVX-512: `tools/avx512-bochs` runs the twin tests on an emulated
//! AVX-512 CPU. Spec sections refer to the model contract, `docs/MODEL.md` at the workspace
//! root.

#![warn(missing_docs)]

pub mod bf16;
pub mod copy;
pub mod dot;
mod error;
pub mod hash;
mod isa;
pub mod kda;
mod kernels;
pub mod math;
pub mod mxfp4;
mod out;
mod par;
mod peak;
pub mod softmax;
#[cfg(test)]
mod testutil;
#[cfg(target_arch = "x86_64")]
mod tiled;
#[cfg(target_arch = "x86_64")]
mod tiles512;
pub mod vector;

pub use bf16::bf16_to_f32;
pub use copy::copy_streaming;
pub use error::KernelError;
pub use isa::{Avx512Many, Isa};
pub use kernels::Kernels;
pub use mxfp4::{mxfp4_value, Avx2Mxfp4};
/// Rows per block of the parallel products: callers that hand the weights over in row blocks
/// use multiples of it so that a block splits over threads as the whole product does.
pub use par::ROWS_PER_BLOCK;
pub use par::{while_blocked, with_workers_awake};
