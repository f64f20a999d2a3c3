//! XXH3-64 throughput, this crate's loops against `xxhash-rust` as the build compiles it (SSE2
//! on a portable x86-64 build), in bytes hashed per second: a 112 KiB run of an expert's rows as
//! the products hand them over (in the core's cache), and 64 MiB from memory. The ISA is the
//! host's best unless `K3_BENCH_ISA` names another.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

// The other benches use the rest of the shared helpers.
#[allow(dead_code)]
mod common;
use common::{kernels_under_test, Lcg};

fn bench_xxh3(c: &mut Criterion) {
    let k = kernels_under_test();
    let mut rng = Lcg(7);
    for (name, len) in [("in_cache_112k", 64 * 1792), ("from_memory_64m", 64 << 20)] {
        let bytes = rng.bytes(len);
        let mut group = c.benchmark_group(format!("xxh3_{name}"));
        group.throughput(Throughput::Bytes(len as u64));
        group.sample_size(20);
        group.bench_function(BenchmarkId::new("xxhash-rust", "streaming"), |b| {
            b.iter(|| {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                h.update(black_box(&bytes));
                h.digest()
            })
        });
        group.bench_function(BenchmarkId::new(format!("kernels_{}", k.isa()), "streaming"), |b| {
            b.iter(|| {
                let mut h = k.xxh3();
                h.update(black_box(&bytes));
                h.digest()
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench_xxh3);
criterion_main!(benches);
