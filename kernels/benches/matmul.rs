//! Matmul throughput at K3 shapes, in bytes of weights streamed per second.
//!
//! bf16: 7168x12288 (KDA/MLA `o_proj`) and 12288x7168 (`q_proj`...), 176 MB each: far larger
//! than the 32 MB L3, so every call streams from DRAM. MXFP4: one expert matrix
//! (3072x3584 = w1/w3, 3584x3072 = w2) is 5.8 MB and would sit in L3, so the bench rotates
//! through 8 distinct copies (46 MB) to measure streaming as the engine sees it. Each shape runs
//! for t = 1 (decode) and t = 16 (prefill chunk), serially and on a 2-thread rayon pool
//! (`par2`), with the best ISA of the host unless `K3_BENCH_ISA` names another.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

mod common;
use common::{kernels_under_test, Lcg};

fn bench_bf16(c: &mut Criterion) {
    let k = kernels_under_test();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let mut rng = Lcg(1);
    for (rows, cols) in [(7168usize, 12288usize), (12288, 7168)] {
        let w = rng.bf16_bytes(rows * cols);
        let mut group = c.benchmark_group(format!("bf16_{rows}x{cols}_{}", k.isa()));
        group.throughput(Throughput::Bytes(w.len() as u64));
        group.sample_size(10);
        for t in [1usize, 16] {
            let x: Vec<f32> = (0..t * cols).map(|_| rng.f32()).collect();
            let mut y = vec![0.0f32; t * rows];
            group.bench_function(BenchmarkId::new("serial", format!("t{t}")), |b| {
                b.iter(|| k.matmul_bf16(black_box(&w), rows, cols, black_box(&x), t, &mut y));
            });
            group.bench_function(BenchmarkId::new("par2", format!("t{t}")), |b| {
                b.iter(|| pool.install(|| k.par_matmul_bf16(black_box(&w), rows, cols, black_box(&x), t, &mut y)));
            });
        }
        group.finish();
    }
}

fn bench_mxfp4(c: &mut Criterion) {
    const COPIES: usize = 8;
    let k = kernels_under_test();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let mut rng = Lcg(2);
    for (rows, cols) in [(3072usize, 3584usize), (3584, 3072)] {
        let experts = rng.mxfp4_copies(COPIES, rows, cols);
        let bytes = (rows * cols / 2 + rows * cols / 32) as u64;
        let mut group = c.benchmark_group(format!("mxfp4_{rows}x{cols}_{}", k.isa()));
        group.throughput(Throughput::Bytes(bytes));
        for t in [1usize, 16] {
            let x: Vec<f32> = (0..t * cols).map(|_| rng.f32()).collect();
            let mut y = vec![0.0f32; t * rows];
            let mut i = 0;
            group.bench_function(BenchmarkId::new("serial", format!("t{t}")), |b| {
                b.iter(|| {
                    let (p, s) = &experts[i % COPIES];
                    i += 1;
                    k.matmul_mxfp4(black_box(p), black_box(s), rows, cols, black_box(&x), t, &mut y).unwrap();
                });
            });
            group.bench_function(BenchmarkId::new("par2", format!("t{t}")), |b| {
                b.iter(|| {
                    let (p, s) = &experts[i % COPIES];
                    i += 1;
                    pool.install(|| {
                        k.par_matmul_mxfp4(black_box(p), black_box(s), rows, cols, black_box(&x), t, &mut y)
                    })
                    .unwrap();
                });
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench_bf16, bench_mxfp4);
criterion_main!(benches);
