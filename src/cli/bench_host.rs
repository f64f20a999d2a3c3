//! What the host charges `bench`'s cells: the machine's identity, the read tax (what a read in
//! flight costs compute, `engine::read_tax`), the floors with that tax charged, and where each
//! cell's time goes beside them.

use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

use crate::checkpoint::CheckpointIndex;
use crate::engine::measure::{MeasureSpec, Measurement};
use crate::engine::read_tax::{measure_read_tax, ReadTax, StreamSpec};
use crate::pipeline::{IoKind, IoOptions};
use crate::storage::io::probe::{random_read_rate, random_read_rate_through};
use crate::storage::io::{modeled::warm_ranges, ModeledReader};

/// The machine a table was measured on.
#[derive(Clone, Debug, Serialize)]
pub struct Host {
    /// `/proc/cpuinfo`'s model name.
    pub cpu_model: String,
    /// The kernels' instruction set.
    pub isa: String,
    /// How the AVX-512 products run many tokens (`tiles` or `passes`), on AVX-512 only.
    pub many_tokens: Option<String>,
    pub cores: usize,
    /// The backend the cells read through (`uring`, or the modeled device's spec).
    pub io: String,
}

impl Host {
    pub fn detect(kernels: kernels::Kernels, io: IoKind) -> Host {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".to_owned());
        Host {
            cpu_model,
            isa: kernels.isa().name().to_owned(),
            many_tokens: kernels.avx512_many().map(|v| v.name().to_owned()),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            io: io.display_name(),
        }
    }
}

/// What the device probes read: the files, their ranges, and what they are (for the report).
pub struct ProbeTarget {
    pub files: Vec<PathBuf>,
    pub ranges: Vec<(usize, u64, u64)>,
    pub source: String,
}

/// The probes' target: for a real device with `pack --experts-to` files in `trunk`, those files
/// (the drives the cells read experts from, read at once through one ring, so the probe gives
/// their combined rate); otherwise the shards, as [`probe_ranges`] says.
pub fn probe_target(index: &CheckpointIndex, trunk: &std::path::Path, io: IoKind) -> anyhow::Result<ProbeTarget> {
    if io.modeled().is_none() {
        let manifest = crate::storage::pack::Manifest::load(trunk)?;
        if let Some(ef) = crate::storage::expert_files::ExpertFiles::open(trunk, &manifest, index)? {
            // Equal spans, so that a probe read lands on each file in proportion to its bytes,
            // as the cells' striped reads do.
            let span = 16
                * index
                    .experts
                    .iter()
                    .next()
                    .map_or(1 << 20, |r| crate::checkpoint::ExpertImage::new(&index.tensors, r, ef.manifest.align).len);
            let ranges = ef
                .manifest
                .devices
                .iter()
                .enumerate()
                .flat_map(|(i, d)| (0..d.len.div_ceil(span)).map(move |k| (i, k * span, ((k + 1) * span).min(d.len))))
                .collect();
            let source = format!("the expert files on {} devices", ef.paths.len());
            return Ok(ProbeTarget { files: ef.paths, ranges, source });
        }
    }
    let files = index.shards.iter().map(|s| s.path.clone()).collect();
    Ok(ProbeTarget { files, ranges: probe_ranges(index, io), source: "the shards".to_owned() })
}

/// Where reads go for the probes: the shards' data for a real device; for a modeled one, the
/// experts only (runs of adjacent experts merged), which it serves from the page cache.
pub fn probe_ranges(index: &CheckpointIndex, io: IoKind) -> Vec<(usize, u64, u64)> {
    if io.modeled().is_none() {
        return index.shards.iter().enumerate().map(|(i, s)| (i, s.data_start, s.file_len)).collect();
    }
    let mut spans: Vec<(usize, u64, u64)> = Vec::new();
    for r in index.experts.iter() {
        match r.contiguous {
            Some(span) => spans.push(span),
            None => spans.extend(r.parts.iter().map(|&id| {
                let t = &index.tensors[id];
                (t.shard, t.offset, t.offset + t.len)
            })),
        }
    }
    spans.sort_unstable();
    let mut merged: Vec<(usize, u64, u64)> = Vec::with_capacity(spans.len());
    for (f, a, b) in spans {
        match merged.last_mut() {
            Some(last) if last.0 == f && a <= last.2 + 4096 => last.2 = last.2.max(b),
            _ => merged.push((f, a, b)),
        }
    }
    merged
}

/// Before a modeled device's probes: its reads copy from the page cache, so read the ranges in.
/// Refuses (naming `--io`) a checkpoint where no run of experts holds one expert-sized read.
pub fn warm_for_probes(
    files: &[PathBuf],
    ranges: &[(usize, u64, u64)],
    io: IoKind,
    read_bytes: u64,
) -> anyhow::Result<()> {
    if io.modeled().is_some() {
        if !ranges
            .iter()
            .any(|&(_, a, b)| b.saturating_sub(a.div_ceil(4096) * 4096) >= read_bytes.div_ceil(4096) * 4096)
        {
            return Err(crate::error::UsageError(format!(
                "--io {}: no run of this checkpoint's experts holds one expert's {read_bytes} bytes for the probes",
                io.display_name()
            ))
            .into());
        }
        warm_ranges(files, ranges).context("reading the experts into the page cache for --io sim")?;
    }
    Ok(())
}

/// The device's random read rate of `read_bytes` windows at `qd` reads in flight, through the
/// cells' backend: O_DIRECT io_uring for a real device, the model for `--io sim:`.
pub fn device_rate(
    ProbeTarget { files, ranges, .. }: &ProbeTarget,
    io: IoKind,
    read_bytes: usize,
    qd: u32,
    reads: usize,
    seed: u64,
) -> anyhow::Result<f64> {
    let rate = match io.modeled() {
        Some(model) => {
            let reader = ModeledReader::new(files, model, qd.max(1) as usize)?;
            random_read_rate_through(Box::new(reader), ranges, read_bytes, qd, reads, seed)?
        }
        None => random_read_rate(files, ranges, read_bytes, qd, reads, seed)?,
    };
    Ok(rate)
}

/// What the read-tax stream reads: the files, the ranges, the cells' backend and queue depth,
/// and the bytes per read (one expert).
pub type StreamOf<'a> = (&'a [PathBuf], &'a [(usize, u64, u64)], &'a IoOptions, usize);

/// Measures the read tax with the cells' backend and queue depth (`repeats` alternated pairs).
pub fn read_tax(
    model: &std::path::Path,
    kernels: kernels::Kernels,
    threads: usize,
    spec: &MeasureSpec,
    (files, ranges, io, read_bytes): StreamOf<'_>,
    repeats: usize,
) -> anyhow::Result<ReadTax> {
    let align = crate::pipeline::io_stage::read_alignment(files, io)?;
    let stream = StreamSpec { files: files.to_vec(), ranges: ranges.to_vec(), read_bytes, io: io.clone(), align };
    let tax = measure_read_tax(model, kernels, threads, spec, &stream, repeats).context("measuring the read tax")?;
    Ok(tax)
}

/// A cell's floors with the tax charged, and where its time goes.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct HostFloors {
    /// `max(bytes / device, compute + tax x bytes)`: every read may start early, and each costs
    /// compute what the probe measured.
    pub floor_host_seconds_per_token: f64,
    pub efficiency_host: f64,
    /// The floor without routing prediction with the tax charged: `max(floor_host, the compute
    /// expert reads cannot overlap + tax x trunk bytes + the routed seconds)`, the routed
    /// seconds summed per step and layer ([`ExpertReads::routed_seconds`]).
    pub floor_no_prediction_host_seconds_per_token: Option<f64>,
    pub efficiency_no_prediction_host: Option<f64>,
    /// Where the measured time goes: resident compute, compute lost to reads (the tax on this
    /// cell's bytes), compute waiting for reads (stalls), expert checksums hashed on the compute
    /// path (the engine's own work, which the floors leave out; hashing inside stalls counts
    /// as waited), and the rest (scheduling, and what none of those explain; negative when the
    /// parts overlap).
    pub compute_seconds_per_token: f64,
    pub tax_seconds_per_token: f64,
    pub waited_seconds_per_token: f64,
    pub checks_seconds_per_token: f64,
    pub rest_seconds_per_token: f64,
    /// [`shared_floor`]: `floor_host` when the device also reads slower beside compute (at the
    /// read-tax stream's rate), as a modeled device's copy does on the cores compute runs on.
    pub floor_shared_host_seconds_per_token: f64,
    pub efficiency_shared_host: f64,
    /// `max(floor_shared_host, the no-prediction term of floor_no_prediction_host)`.
    pub floor_no_prediction_shared_host_seconds_per_token: Option<f64>,
    pub efficiency_no_prediction_shared_host: Option<f64>,
    /// Seconds per token with no read in flight: in a device-bound cell, the time reads were not
    /// started (nothing asked for yet, or held back by the routing dependency).
    pub device_idle_seconds_per_token: f64,
    /// What the device loses while the cores compute beside it: `(compute + tax) x (1 - the
    /// read-tax stream's rate beside compute / device rate)`, 0 when the stream kept up. In a
    /// device-bound cell, seconds per token the host's slowdown of the device adds to
    /// `bytes / device` (the floors do not charge it).
    pub device_slowed_seconds_per_token: f64,
}

/// The floors of a cell that read `m`'s bytes at `device_rate`, from the resident compute and
/// its overlappable part, with `tax` charged.
pub fn host_floors(m: &Measurement, resident: &Measurement, device_rate: f64, tax: &ReadTax) -> HostFloors {
    let (trunk, experts) = (m.trunk_bytes_per_token, m.expert_bytes_per_token);
    let compute = resident.seconds_per_token;
    let charged = tax.charge(trunk + experts);
    let reads = (trunk, ExpertReads::of(m, resident));
    let overlap = (compute, resident.overlappable_seconds_per_token);
    let (floor, no_prediction) = charged_floors(reads, overlap, device_rate, tax);
    let (shared, shared_no_prediction) = shared_floors(reads, overlap, device_rate, tax);
    let spt = m.seconds_per_token;
    HostFloors {
        floor_host_seconds_per_token: floor,
        efficiency_host: floor / spt,
        floor_no_prediction_host_seconds_per_token: no_prediction,
        efficiency_no_prediction_host: no_prediction.map(|f| f / spt),
        floor_shared_host_seconds_per_token: shared,
        efficiency_shared_host: shared / spt,
        floor_no_prediction_shared_host_seconds_per_token: shared_no_prediction,
        efficiency_no_prediction_shared_host: shared_no_prediction.map(|f| f / spt),
        compute_seconds_per_token: compute,
        tax_seconds_per_token: charged,
        waited_seconds_per_token: m.stall_seconds_per_token,
        checks_seconds_per_token: m.expert_verify_seconds_per_token,
        rest_seconds_per_token: spt - compute - charged - m.stall_seconds_per_token - m.expert_verify_seconds_per_token,
        device_idle_seconds_per_token: spt * (1.0 - m.io_busy_fraction),
        device_slowed_seconds_per_token: device_slowed(compute + charged, tax.read_rate, device_rate),
    }
}

/// A cell's expert reads, as the floor without prediction needs them.
#[derive(Clone, Copy, Debug)]
pub enum ExpertReads<'a> {
    /// Bytes per token (or step), not split by layer: the floor lets every layer's reads
    /// overlap the expert compute of every layer (batch cells).
    Total(f64),
    /// Bytes per token, and the bytes read for each layer in each measured step over `tokens`
    /// tokens, with `moe_layers` layers sharing the overlappable compute equally.
    ByLayer { bytes: f64, steps: &'a [Vec<u64>], tokens: f64, moe_layers: usize },
}

impl<'a> ExpertReads<'a> {
    /// `m`'s expert reads, split by step and layer when it measured them and the resident run
    /// counted its expert layers.
    pub fn of(m: &'a Measurement, resident: &Measurement) -> ExpertReads<'a> {
        let steps = &m.expert_bytes_by_step;
        let tokens = m.draft.map_or(steps.len() as f64, |d| (d.steps + d.accepted) as f64);
        if steps.is_empty() || resident.moe_layers == 0 || tokens <= 0.0 {
            return ExpertReads::Total(m.expert_bytes_per_token);
        }
        ExpertReads::ByLayer { bytes: m.expert_bytes_per_token, steps, tokens, moe_layers: resident.moe_layers }
    }

    pub fn bytes(&self) -> f64 {
        match *self {
            ExpertReads::Total(b) | ExpertReads::ByLayer { bytes: b, .. } => b,
        }
    }

    /// Per token: the time from the routers to the last expert computed, when a layer's reads
    /// start at its router and overlap its own `overlappable` share (the whole `overlappable`
    /// for [`ExpertReads::Total`]): `max(overlappable, bytes / rate)`, or per step and layer
    /// `sum max(step's overlappable / layers, layer bytes / rate) / tokens`, a step's
    /// overlappable compute being `overlappable x tokens / steps`. A read that overlaps another
    /// layer's compute started before its router: that is prediction.
    pub fn routed_seconds(&self, overlappable: f64, device_rate: f64) -> f64 {
        match *self {
            ExpertReads::Total(b) => overlappable.max(b / device_rate),
            ExpertReads::ByLayer { steps, tokens, moe_layers, .. } => {
                // A step computes the experts of tokens / steps tokens (more than one when drafted).
                let step_overlappable = overlappable * tokens / steps.len().max(1) as f64;
                let per_layer = step_overlappable / moe_layers as f64;
                let step_seconds = |layers: &Vec<u64>| {
                    let read: f64 = layers.iter().map(|&b| (b as f64 / device_rate - per_layer).max(0.0)).sum();
                    step_overlappable + read
                };
                steps.iter().map(step_seconds).sum::<f64>() / tokens
            }
        }
    }
}

/// Seconds a device at `device_rate` loses over `busy` seconds of compute during which it reads
/// at `beside` (the read-tax stream's rate beside compute) instead.
pub fn device_slowed(busy: f64, beside: f64, device_rate: f64) -> f64 {
    if device_rate > 0.0 && beside > 0.0 {
        busy * (1.0 - beside / device_rate).max(0.0)
    } else {
        0.0
    }
}

/// The floors of a token or step that reads `trunk` bytes and `experts` at `device_rate`, whose
/// resident compute is `compute` (of which `overlappable` can overlap expert reads without
/// prediction), with `tax` charged per byte: `max(bytes / rate, compute + tax x bytes)`, and
/// without prediction `max(that, compute - overlappable + tax x trunk + the routed seconds)`
/// (the trunk reads run beside the compute expert reads cannot overlap; the routed seconds are
/// [`ExpertReads::routed_seconds`]).
pub fn charged_floors(
    (trunk, experts): (f64, ExpertReads<'_>),
    (compute, overlappable): (f64, Option<f64>),
    device_rate: f64,
    tax: &ReadTax,
) -> (f64, Option<f64>) {
    let bytes = trunk + experts.bytes();
    let floor = (bytes / device_rate).max(compute + tax.charge(bytes));
    (floor, overlappable.map(|o| floor.max(no_prediction_term((trunk, experts), (compute, o), device_rate, tax))))
}

/// The part of the floor without prediction that the compute side sets: the compute expert
/// reads cannot overlap, the tax on the trunk read beside it, and the routed seconds.
fn no_prediction_term(
    (trunk, experts): (f64, ExpertReads<'_>),
    (compute, overlappable): (f64, f64),
    device_rate: f64,
    tax: &ReadTax,
) -> f64 {
    compute - overlappable + tax.charge(trunk) + experts.routed_seconds(overlappable, device_rate)
}

/// [`charged_floors`] with [`shared_floor`] in place of `max(bytes / rate, compute + tax *
/// bytes)`.
fn shared_floors(
    (trunk, experts): (f64, ExpertReads<'_>),
    (compute, overlappable): (f64, Option<f64>),
    device_rate: f64,
    tax: &ReadTax,
) -> (f64, Option<f64>) {
    let floor = shared_floor(trunk + experts.bytes(), compute, device_rate, tax);
    (floor, overlappable.map(|o| floor.max(no_prediction_term((trunk, experts), (compute, o), device_rate, tax))))
}

/// The shortest token that reads `bytes` when the cores and the device share the host both
/// ways: while compute runs (`compute` seconds, plus the tax on what is read meanwhile) the
/// device delivers the read-tax stream's rate beside compute, `beside` (never above
/// `device_rate`); with compute done (or waiting), `device_rate`. Reading `x` bytes beside
/// compute takes `compute + tax * x + (bytes - x) / device_rate`, linear in `x`, so the least
/// is at one end: as much as the device delivers beside compute, `x = beside * (compute + tax *
/// x)` capped at `bytes`, or nothing (when a byte's tax outweighs its device time). With
/// `beside = device_rate` this is `max(bytes / device_rate, compute + tax * bytes)` (the
/// `floor_host` formula) unless a byte's tax outweighs its device time, where reading beside
/// compute is not the fastest way and `compute + bytes / device_rate` is: there, and wherever
/// `tax * beside` is large enough that reading after compute wins, it is below `floor_host`,
/// which is then no floor.
pub fn shared_floor(bytes: f64, compute: f64, device_rate: f64, tax: &ReadTax) -> f64 {
    if bytes <= 0.0 {
        return compute;
    }
    if device_rate <= 0.0 {
        return f64::INFINITY;
    }
    let beside = if tax.read_rate > 0.0 { tax.read_rate.min(device_rate) } else { device_rate };
    let per_byte = tax.charge(1.0);
    let room = 1.0 - beside * per_byte;
    let overlapped = if room > 0.0 { (beside * compute / room).min(bytes) } else { bytes };
    let beside_then_after = compute + per_byte * overlapped + (bytes - overlapped) / device_rate;
    beside_then_after.min(compute + bytes / device_rate)
}

/// The host line and the tax line of the report.
pub fn print_host(host: &Host, tax: Option<&ReadTax>) {
    let many = host.many_tokens.as_ref().map_or(String::new(), |v| format!(", many tokens as {v}"));
    println!("host: {} ({}{many}, {} cores), cells read through {}", host.cpu_model, host.isa, host.cores, host.io);
    match tax {
        Some(t) => println!(
            "read tax (resident decode quiet vs with a stream of reads through {} at {:.2} GB/s, {} alternated pairs): \
             tau {:.3} (spread {:.3}..{:.3}) compute s per s of reading, {:.3} s per GB ({:.3}..{:.3}); ids {}",
            t.backend,
            t.read_rate / 1e9,
            t.samples.len(),
            t.tau,
            t.tau_min,
            t.tau_max,
            t.seconds_per_gb,
            t.seconds_per_gb_min,
            t.seconds_per_gb_max,
            if t.ids_identical { "identical" } else { "DIFFER" }
        ),
        None => println!("read tax: not measured (--no-read-tax); no host floors"),
    }
}

/// One line per cell: its host floors and where its time goes.
pub fn print_host_cells<'a>(cells: impl Iterator<Item = (f64, &'a str, f64, &'a HostFloors)>) {
    println!(
        "{:>7} {:>10} {:>9} {:>8} {:>7} {:>8} {:>7} {:>8} {:>7} {:>7} | {:>8} {:>8} {:>8} {:>8} {:>8} | {:>8} {:>10}",
        "budget",
        "mode",
        "s/token",
        "floor_h",
        "effic_h",
        "floor*_h",
        "eff*_h",
        "floor_hs",
        "eff_hs",
        "eff*_hs",
        "compute",
        "tax",
        "waited",
        "checks",
        "rest",
        "dev idle",
        "dev slowed"
    );
    for (budget, mode, spt, h) in cells {
        println!(
            "{:>6}G {:>10} {:>9.3} {:>8.3} {:>7.2} {} {} {:>8.3} {:>7.2} {} | {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} | {:>8.3} {:>10.3}",
            budget,
            mode,
            spt,
            h.floor_host_seconds_per_token,
            h.efficiency_host,
            super::bench::or_dash(h.floor_no_prediction_host_seconds_per_token, 8, 3),
            super::bench::or_dash(h.efficiency_no_prediction_host, 7, 2),
            h.floor_shared_host_seconds_per_token,
            h.efficiency_shared_host,
            super::bench::or_dash(h.efficiency_no_prediction_shared_host, 7, 2),
            h.compute_seconds_per_token,
            h.tax_seconds_per_token,
            h.waited_seconds_per_token,
            h.checks_seconds_per_token,
            h.rest_seconds_per_token,
            h.device_idle_seconds_per_token,
            h.device_slowed_seconds_per_token
        );
    }
    println!(
        "floor_h: the floor with the read tax charged, max(bytes / device, compute + s/GB x bytes); floor*_h: the same \
         without routing prediction; floor_hs (eff_hs, and eff*_hs against floor*_hs, which --json holds): the same \
         when the device also reads at the read-tax stream's rate beside compute, and at its own rate only while \
         compute is done or waits (the host shares itself both ways; equal to floor_h where the stream kept the \
         device's rate and a byte's tax is below its device time). s/token = compute + tax (compute lost to reads) + waited (compute waiting for \
         reads; expert checks hashed meanwhile count here) + checks (expert checksums hashed on the compute path) + \
         rest (scheduling, and overlap of the parts); dev idle: no read in flight (in a device-bound cell, \
         reads not started); dev slowed: (compute + tax) x (1 - the read-tax stream's rate beside compute / the \
         device's), what the device loses while the cores compute (in a device-bound cell, time the floors do not \
         charge)"
    );
}

#[cfg(test)]
mod tests {
    use super::ExpertReads;

    const RATE: f64 = 1e9;

    #[test]
    fn a_layer_whose_reads_outlast_its_compute_does_not_borrow_another_layers() {
        // Two expert layers share 20 ms of overlappable compute; layer 0 is dense.
        let bunched = [vec![0, 30_000_000, 0]];
        let spread = [vec![0, 15_000_000, 15_000_000]];
        fn by_layer(steps: &[Vec<u64>]) -> ExpertReads<'_> {
            ExpertReads::ByLayer { bytes: 30e6, steps, tokens: 1.0, moe_layers: 2 }
        }
        // Bunched: 30 ms of reads after layer 1's router, then layer 2's own 10 ms.
        assert!((by_layer(&bunched).routed_seconds(0.02, RATE) - 0.04).abs() < 1e-12);
        // Spread evenly, each layer reads 15 ms against its 10: the unsplit bound holds.
        assert!((by_layer(&spread).routed_seconds(0.02, RATE) - 0.03).abs() < 1e-12);
        assert!((ExpertReads::Total(30e6).routed_seconds(0.02, RATE) - 0.03).abs() < 1e-12);
        // With nothing to read, the experts' compute remains.
        assert!((by_layer(&[vec![0, 0, 0]]).routed_seconds(0.02, RATE) - 0.02).abs() < 1e-12);
    }

    #[test]
    fn a_device_slowed_beside_compute_loses_that_share_of_the_compute_seconds() {
        // 0.4 s of compute and tax while the device reads at 3 of its 4 GB/s: 0.1 s lost.
        assert!((super::device_slowed(0.4, 3e9, 4e9) - 0.1).abs() < 1e-12);
        // A stream that kept up (or beat the probe), and no measurement: nothing.
        assert_eq!(super::device_slowed(0.4, 4.2e9, 4e9), 0.0);
        assert_eq!(super::device_slowed(0.4, 0.0, 4e9), 0.0);
    }

    fn tax(seconds_per_gb: f64, read_rate: f64) -> crate::engine::read_tax::ReadTax {
        crate::engine::read_tax::ReadTax {
            backend: "sim".to_owned(),
            tau: 0.0,
            tau_min: 0.0,
            tau_max: 0.0,
            seconds_per_gb,
            seconds_per_gb_min: seconds_per_gb,
            seconds_per_gb_max: seconds_per_gb,
            read_rate,
            ids_identical: true,
            samples: Vec::new(),
        }
    }

    #[test]
    fn the_shared_floor_is_floor_host_when_the_device_keeps_its_rate_beside_compute() {
        let floor_h = |bytes: f64, compute: f64, t: &crate::engine::read_tax::ReadTax| {
            (bytes / 10e9).max(compute + t.charge(bytes))
        };
        // Device-bound (2 s of reads against 1.4 s of compute and tax) and compute-bound (0.2 s
        // of reads against 0.5 s).
        for (bytes, compute) in [(20e9, 0.4), (2e9, 0.4)] {
            for beside in [10e9, 12e9, 0.0] {
                let t = tax(0.05, beside);
                let got = super::shared_floor(bytes, compute, 10e9, &t);
                assert!((got - floor_h(bytes, compute, &t)).abs() < 1e-12, "{bytes} {compute} {beside}: {got}");
            }
        }
        // Nothing to read: the compute.
        assert_eq!(super::shared_floor(0.0, 0.4, 10e9, &tax(0.05, 5e9)), 0.4);
    }

    #[test]
    fn a_device_slowed_beside_compute_reads_the_rest_at_its_own_rate_afterwards() {
        // 1 s of compute, 0.05 s per GB of tax, the device at 5 GB/s beside compute and 10 alone:
        // beside compute it reads x = 5 GB/s x (1 + 0.05 x x), x = 5 / 0.75 GB, over 1 + x / 20 s.
        let t = tax(0.05, 5e9);
        let x = 5.0 / 0.75;
        let want = 1.0 + x / 20.0 + (20.0 - x) / 10.0;
        assert!((super::shared_floor(20e9, 1.0, 10e9, &t) - want).abs() < 1e-9);
        // Above floor_host (2 s) by what the slowed device could not read beside compute.
        assert!(want > 2.0);
        // Compute-bound: all 3 GB fit beside compute, so the tax alone is charged, as floor_host does.
        assert!((super::shared_floor(3e9, 1.0, 10e9, &t) - 1.15).abs() < 1e-12);
        // A byte's tax above its device time: reading after compute is faster than beside it.
        let dear = tax(0.5, 5e9);
        assert!((super::shared_floor(20e9, 1.0, 10e9, &dear) - 3.0).abs() < 1e-12);
        // Below that, but the device slowed enough: all 20 GB beside compute take 1 + 3 s (x =
        // 5 / 0.25 GB), after it 1 + 2 s; floor_host would say 4 s.
        let slow = tax(0.15, 5e9);
        assert!((super::shared_floor(20e9, 1.0, 10e9, &slow) - 3.0).abs() < 1e-12);
    }

    #[test]
    fn routed_seconds_are_per_token_over_steps_that_chose_several() {
        // Two drafted steps chose three tokens between them: each step computes 1.5 tokens'
        // experts, 30 ms of overlappable compute, 15 ms per layer.
        let steps = [vec![0, 30_000_000, 0], vec![0, 0, 0]];
        let reads = ExpertReads::ByLayer { bytes: 10e6, steps: &steps, tokens: 3.0, moe_layers: 2 };
        assert!((reads.routed_seconds(0.02, RATE) - ((0.03 + 0.015) + 0.03) / 3.0).abs() < 1e-12);
        assert_eq!(reads.bytes(), 10e6);
        // Nothing read: the experts' compute per token remains.
        let quiet = [vec![0, 0, 0], vec![0, 0, 0]];
        let reads = ExpertReads::ByLayer { bytes: 0.0, steps: &quiet, tokens: 3.0, moe_layers: 2 };
        assert!((reads.routed_seconds(0.02, RATE) - 0.02).abs() < 1e-12);
    }
}
