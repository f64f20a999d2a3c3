//! The matmul kernels against this machine's own limits, measured in the same run:
//! single-token products as GB/s of weight bytes over the STREAM triad's GB/s, 16-token products
//! as GFLOP/s over the FMA peak (independent `vfmadd` chains on every thread).
//!
//! `cargo bench -p k3ring-kernels --bench roofline [-- --threads N --repeats N --isa NAME
//! --only bf16|mxfp4 --tokens 1,2,... --hot --avx2-mxfp4 ymm|xmm --avx512-many tiles|passes]` (`--only` restricts the
//! kernel rows and `--tokens` sets their token counts, any of them; the limits are always
//! measured; `--hot` adds rows of an MXFP4 256x3584 and a bf16 128x2048 matrix that stay in L2,
//! 100 products per timing: the kernels' rate when memory is not the limit, on one thread (the
//! bf16 one has only two 64-row blocks, so its multi-thread rows mostly show fork and join);
//! `--avx2-mxfp4` runs that AVX2 one-token MXFP4 kernel instead of this CPU's choice,
//! `--avx512-many` that AVX-512 many-token loop: tiles from 5 bf16 or 10 MXFP4 tokens, or passes).
//!
//! Every number is the median of `--repeats` timings (default 9); the triad and the FMA peak are
//! measured before and after the kernels and the better of the two medians is the limit, so a
//! noisy neighbour lowers ratios rather than inflating them. Shapes are K3's: bf16 7168x12288 and
//! 12288x7168, MXFP4 3072x3584 and 3584x3072 (MXFP4 rotates through 8 copies, 46 MB, so each call
//! streams from DRAM as an expert read from storage would).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::print_stderr)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use kernels::{Avx2Mxfp4, Avx512Many, Isa, Kernels};

mod common;
use common::Lcg;

struct Options {
    threads: usize,
    repeats: usize,
    isa: Isa,
    /// `Some("bf16")` or `Some("mxfp4")`: only that format's rows.
    only: Option<String>,
    /// `--tokens`: the token counts to measure; by default 1, 2, 3, 4 and 16 (bf16 skips 3).
    tokens: Option<Vec<usize>>,
    /// Also measure an L2-resident MXFP4 and bf16 matrix.
    hot: bool,
    /// `--avx2-mxfp4 ymm|xmm`: the AVX2 one-token MXFP4 kernel instead of this CPU's choice.
    avx2_mxfp4: Option<Avx2Mxfp4>,
    /// `--avx512-many tiles|passes`: the AVX-512 many-token loop instead of this CPU's choice.
    avx512_many: Option<Avx512Many>,
}

fn options() -> Options {
    let mut o = Options {
        threads: 2,
        repeats: 9,
        isa: Isa::best(),
        only: None,
        tokens: None,
        hot: false,
        avx2_mxfp4: None,
        avx512_many: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1);
        match args[i].as_str() {
            "--threads" => o.threads = value.and_then(|v| v.parse().ok()).expect("--threads N"),
            "--repeats" => o.repeats = value.and_then(|v| v.parse().ok()).expect("--repeats N"),
            "--isa" => o.isa = value.and_then(|v| Isa::from_name(v)).expect("--isa scalar|avx2|avx512"),
            "--avx2-mxfp4" => {
                o.avx2_mxfp4 = Some(
                    [Avx2Mxfp4::Ymm, Avx2Mxfp4::Xmm]
                        .into_iter()
                        .find(|v| value.is_some_and(|s| s == v.name()))
                        .expect("--avx2-mxfp4 ymm|xmm"),
                )
            }
            "--avx512-many" => {
                o.avx512_many = Some(value.and_then(|v| Avx512Many::from_name(v)).expect("--avx512-many tiles|passes"))
            }
            "--only" => {
                o.only = Some(value.filter(|v| *v == "bf16" || *v == "mxfp4").expect("--only bf16|mxfp4").clone())
            }
            "--tokens" => {
                o.tokens = Some(
                    value
                        .and_then(|v| v.split(',').map(|t| t.parse().ok().filter(|&t| t > 0)).collect())
                        .expect("--tokens 1,2,..."),
                )
            }
            "--hot" => {
                o.hot = true;
                i += 1;
                continue;
            }
            // cargo bench passes --bench; anything else is a criterion-style filter we ignore.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Median wall time of `f` over `repeats` calls, after one warm-up call.
fn time(repeats: usize, mut f: impl FnMut()) -> Duration {
    f();
    median(
        (0..repeats)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed()
            })
            .collect(),
    )
}

/// STREAM triad `a = b + s * c` over 3 x 256 MiB, split over the pool: GB/s counting 3 arrays.
fn triad(pool: &rayon::ThreadPool, repeats: usize) -> f64 {
    const N: usize = 64 << 20;
    let b = vec![1.0f32; N];
    let c = vec![2.0f32; N];
    let mut a = vec![0.0f32; N];
    let threads = pool.current_num_threads();
    let per = N.div_ceil(threads);
    let t = time(repeats, || {
        pool.scope(|s| {
            for ((ac, bc), cc) in a.chunks_mut(per).zip(b.chunks(per)).zip(c.chunks(per)) {
                s.spawn(move |_| {
                    for ((x, y), z) in ac.iter_mut().zip(bc).zip(cc) {
                        *x = *y + 3.0 * *z;
                    }
                });
            }
        });
        black_box(&a);
    });
    (3 * N * 4) as f64 / t.as_secs_f64() / 1e9
}

/// Peak f32 FMA rate of `k`'s ISA on the pool, GFLOP/s: every thread runs the kernels' FMA
/// probe ([`Kernels::fma_chains`]: 12 chains of 256-bit FMAs on AVX2, 16 of 512-bit ones on
/// AVX-512; before 2026-12-05 this bench ran 16 chains of 256-bit FMAs, which spilled out of
/// AVX2's 16 registers and measured 1.6x below the real peak on a Zen 5 host).
fn fma_peak(k: Kernels, pool: &rayon::ThreadPool, repeats: usize) -> f64 {
    const ITERS: usize = 2_000_000;
    let threads = pool.current_num_threads();
    // Flops are linear in the iterations: two per lane and iteration.
    let flops = k.fma_chains(1, 1.0, 0.0).1 * ITERS as u64;
    let t = time(repeats, || {
        pool.scope(|s| {
            for _ in 0..threads {
                s.spawn(|_| {
                    black_box(k.fma_chains(ITERS, black_box(0.999_999), black_box(1e-7)));
                });
            }
        });
    });
    (threads as u64 * flops) as f64 / t.as_secs_f64() / 1e9
}

struct Row {
    name: String,
    t: usize,
    threads: usize,
    bytes: usize,
    flops: usize,
    secs: f64,
}

fn bf16_rows(k: Kernels, pool: &rayon::ThreadPool, o: &Options, rng: &mut Lcg) -> Vec<Row> {
    let mut out = Vec::new();
    let mut shapes = vec![(7168usize, 12288usize, 1usize), (12288, 7168, 1)];
    if o.hot {
        shapes.push((128, 2048, 100));
    }
    for (rows, cols, calls) in shapes {
        let w = rng.bf16_bytes(rows * cols);
        for t in o.tokens.clone().unwrap_or_else(|| vec![1, 2, 4, 16]) {
            let x: Vec<f32> = (0..t * cols).map(|_| rng.f32()).collect();
            let mut y = vec![0.0f32; t * rows];
            for threads in [1, o.threads] {
                let secs = time(o.repeats, || {
                    for _ in 0..calls {
                        if threads == 1 {
                            k.matmul_bf16(black_box(&w), rows, cols, black_box(&x), t, &mut y);
                        } else {
                            pool.install(|| k.par_matmul_bf16(black_box(&w), rows, cols, black_box(&x), t, &mut y));
                        }
                    }
                })
                .as_secs_f64();
                let name = if calls > 1 { format!("bf16 {rows}x{cols} hot") } else { format!("bf16 {rows}x{cols}") };
                let (bytes, flops) = (calls * w.len(), calls * 2 * rows * cols * t);
                out.push(Row { name, t, threads, bytes, flops, secs });
            }
        }
    }
    out
}

fn mxfp4_rows(k: Kernels, pool: &rayon::ThreadPool, o: &Options, rng: &mut Lcg) -> Vec<Row> {
    const COPIES: usize = 8;
    let mut out = Vec::new();
    let mut shapes = vec![(3072usize, 3584usize, COPIES, 1usize), (3584, 3072, COPIES, 1)];
    if o.hot {
        shapes.push((256, 3584, 1, 100));
    }
    for (rows, cols, copies, calls) in shapes {
        let experts = rng.mxfp4_copies(copies, rows, cols);
        let bytes = calls * (rows * cols / 2 + rows * cols / 32);
        // 2-4: the rows a batch step routes to one expert (issue 18).
        for t in o.tokens.clone().unwrap_or_else(|| vec![1, 2, 3, 4, 16]) {
            let x: Vec<f32> = (0..t * cols).map(|_| rng.f32()).collect();
            let mut y = vec![0.0f32; t * rows];
            for threads in [1, o.threads] {
                let mut i = 0;
                let secs = time(o.repeats, || {
                    for _ in 0..calls {
                        let (p, s) = &experts[i % copies];
                        i += 1;
                        if threads == 1 {
                            k.matmul_mxfp4(black_box(p), black_box(s), rows, cols, black_box(&x), t, &mut y).unwrap();
                        } else {
                            pool.install(|| k.par_matmul_mxfp4(black_box(p), black_box(s), rows, cols, &x, t, &mut y))
                                .unwrap();
                        }
                    }
                })
                .as_secs_f64();
                let name = if calls > 1 { format!("mxfp4 {rows}x{cols} hot") } else { format!("mxfp4 {rows}x{cols}") };
                out.push(Row { name, t, threads, bytes, flops: calls * 2 * rows * cols * t, secs });
            }
        }
    }
    out
}

fn main() {
    let o = options();
    let mut k = Kernels::with_isa(o.isa).expect("ISA not available on this host");
    if let Some(v) = o.avx2_mxfp4 {
        k = k.with_avx2_mxfp4(v);
    }
    if let Some(v) = o.avx512_many {
        k = k.with_avx512_many(v);
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(o.threads).build().unwrap();
    let single = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    eprintln!("measuring limits, then kernels ({} repeats, isa {}, {} threads)...", o.repeats, k.isa(), o.threads);
    let bw_before = [triad(&single, o.repeats), triad(&pool, o.repeats)];
    // The roof's FMA peak is at the width the kernels compute in: zmm for the AVX-512 kernels.
    let zmm = k.isa() == Isa::Avx512;
    let roof_peak = |p: &rayon::ThreadPool| fma_peak(k, p, o.repeats);
    let peak_before = [roof_peak(&single), roof_peak(&pool)];
    let mut rng = Lcg(3);
    let mut rows = Vec::new();
    if o.only.as_deref() != Some("mxfp4") {
        rows.extend(bf16_rows(k, &pool, &o, &mut rng));
    }
    if o.only.as_deref() != Some("bf16") {
        rows.extend(mxfp4_rows(k, &pool, &o, &mut rng));
    }
    let bw_after = [triad(&single, o.repeats), triad(&pool, o.repeats)];
    let peak_after = [roof_peak(&single), roof_peak(&pool)];
    let bw = [bw_before[0].max(bw_after[0]), bw_before[1].max(bw_after[1])];
    let peak = [peak_before[0].max(peak_after[0]), peak_before[1].max(peak_after[1])];
    if let Some(v) = k.avx2_mxfp4() {
        println!("avx2 one-token mxfp4 kernel: {}", v.name());
    }
    if let Some(v) = k.avx512_many() {
        println!("avx-512 many-token loop: {}", v.name());
    }
    println!("isa {}  triad GB/s: 1 thread {:.1}, {} threads {:.1}", k.isa(), bw[0], o.threads, bw[1]);
    let width = if zmm { "zmm" } else { "ymm" };
    println!("      FMA peak GFLOP/s ({width}): 1 thread {:.1}, {} threads {:.1}", peak[0], o.threads, peak[1]);
    if zmm {
        let ymm = Kernels::with_isa(Isa::Avx2).expect("an AVX-512 host has AVX2 + FMA");
        let (y1, y2) = (fma_peak(ymm, &single, o.repeats), fma_peak(ymm, &pool, o.repeats));
        println!("      ymm FMA peak GFLOP/s (not in the roof): 1 thread {y1:.1}, {} threads {y2:.1}", o.threads);
    }
    println!("(limits: better of before/after medians; before {bw_before:.1?} / {peak_before:.1?})");
    println!();
    println!("| shape | tokens | threads | GB/s of weights | / triad | GFLOP/s | / FMA peak | roof GB/s | / roof |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let which = usize::from(r.threads != 1);
        let gbs = r.bytes as f64 / r.secs / 1e9;
        let gflops = r.flops as f64 / r.secs / 1e9;
        // The roofline: weight bytes cannot stream faster than the triad, nor faster than the
        // FMA peak consumes them (every weight is one FMA per token, 2 flops).
        let roof = bw[which].min(peak[which] * r.bytes as f64 / r.flops as f64);
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.2} | {:.1} | {:.2} |",
            r.name,
            r.t,
            r.threads,
            gbs,
            gbs / bw[which],
            gflops,
            gflops / peak[which],
            roof,
            gbs / roof
        );
    }
}
