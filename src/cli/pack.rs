//! `k3ring pack`: write the trunk pack for streaming, with a progress bar; `--verify` then
//! re-reads everything and reports every mismatch.

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::PackArgs;
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::error::UsageError;
use crate::storage::expert_files::{probe_rate, write, write::Weights, ExpertFilesManifest};
use crate::storage::pack::verify::{verify, verify_bytes};
use crate::storage::pack::{write_pack_forced, Manifest, PackError};

/// Mismatches printed one per line before the error (the rest are counted).
const MISMATCHES_SHOWN: usize = 20;

fn bar(what: &str) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} {what} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{binary_bytes_per_sec}} eta {{eta}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar
}

/// Sizes in GB, like every size k3ring prints.
use crate::storage::plan::fmt_gb;

pub fn run(args: &PackArgs) -> anyhow::Result<()> {
    let cfg = Config::from_model_dir(&args.model)?;
    let index = CheckpointIndex::open(&args.model).with_context(|| format!("indexing {}", args.model.display()))?;
    index.validate(&cfg)?;
    let progress = bar("packing trunk, checksumming experts");
    let report = write_pack_forced(&args.model, &cfg, &index, &args.out, (args.force, args.verify), |done, total| {
        progress.set_length(total);
        progress.set_position(done);
    })?;
    progress.finish_and_clear();
    if report.up_to_date {
        println!(
            "trunk pack in {} is up to date ({} units, {}); nothing to do",
            args.out.display(),
            report.units,
            fmt_gb(report.bytes)
        );
    } else {
        if let Some(why) = &report.repacked {
            eprintln!("k3ring: the trunk pack in {} was packed again: {why}", args.out.display());
        }
        println!(
            "packed {} tensors in {} units into {} ({}, units aligned to {} bytes) and checksummed {} experts \
             ({}) in {:.2} s ({:.2} GB/s)",
            report.tensors,
            report.units,
            args.out.display(),
            fmt_gb(report.bytes),
            report.alignment,
            report.experts,
            fmt_gb(report.expert_bytes),
            report.seconds,
            (report.bytes + report.expert_bytes) as f64 / 1e9 / report.seconds.max(1e-9)
        );
    }
    if !args.experts_to.is_empty() {
        write_expert_files(args, &index)?;
    }
    if args.verify {
        verify_everything(args, &cfg, &index)?;
    }
    Ok(())
}

/// `--experts-to`: the experts' files, one per directory, and their manifest in `--out`.
fn write_expert_files(args: &PackArgs, index: &CheckpointIndex) -> anyhow::Result<()> {
    let mut dirs = Vec::with_capacity(args.experts_to.len());
    for dir in &args.experts_to {
        std::fs::create_dir_all(dir).with_context(|| format!("--experts-to: cannot create {}", dir.display()))?;
        let abs = dir.canonicalize().with_context(|| format!("--experts-to: cannot resolve {}", dir.display()))?;
        if dirs.contains(&abs) {
            return Err(UsageError(format!("--experts-to names {} twice", abs.display())).into());
        }
        dirs.push(abs);
    }
    if !args.expert_rates.is_empty() && args.expert_rates.len() != dirs.len() {
        return Err(UsageError(format!(
            "--expert-rates gives {} rates for {} --experts-to directories; give one per directory",
            args.expert_rates.len(),
            dirs.len()
        ))
        .into());
    }
    if let Some(bad) = args.expert_rates.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
        return Err(UsageError(format!("--expert-rates {bad} is not a rate (GB/s above 0)")).into());
    }
    let trunk = Manifest::load(&args.out)?;
    let image_bytes = index
        .experts
        .iter()
        .next()
        .map_or(4096, |r| crate::checkpoint::ExpertImage::new(&index.tensors, r, trunk.alignment).len);
    let weights = || -> Result<Weights, PackError> {
        if args.even {
            return Ok(Weights::Even);
        }
        if !args.expert_rates.is_empty() {
            return Ok(Weights::Rates(args.expert_rates.clone()));
        }
        let mut rates = Vec::with_capacity(dirs.len());
        for dir in &dirs {
            let rate = probe_rate(dir, image_bytes)? / 1e9;
            if !(rate.is_finite() && rate > 0.0) {
                return Err(crate::storage::pack::PackError::Io {
                    op: "probe the read rate of",
                    path: dir.clone(),
                    source: std::io::Error::other(format!(
                        "the probe measured {rate} GB/s; give --expert-rates or --even"
                    )),
                });
            }
            eprintln!("k3ring: {}: {rate:.2} GB/s of random {} reads", dir.display(), fmt_gb(image_bytes));
            rates.push(rate);
        }
        Ok(Weights::Rates(rates))
    };
    let progress = bar("copying experts");
    // A placement of the same kind is kept (probed rates are not probed again to compare).
    let same = |m: &ExpertFilesManifest| match (args.even, args.expert_rates.is_empty()) {
        (true, _) => m.placement == "even",
        (false, true) => m.placement == "weighted",
        (false, false) => {
            m.placement == "weighted" && m.devices.iter().map(|d| d.rate_gb_s).eq(args.expert_rates.iter().copied())
        }
    };
    let report = write::write(&args.out, &trunk, index, &dirs, (&same, &weights), args.force, &|done, total| {
        progress.set_length(total);
        progress.set_position(done);
    })?;
    progress.finish_and_clear();
    let per_device: Vec<String> = report
        .devices
        .iter()
        .map(|d| format!("{} {} (rate {:.2})", d.dir.display(), fmt_gb(d.expert_bytes), d.rate_gb_s))
        .collect();
    if report.up_to_date {
        println!("expert files are up to date ({} experts, {}): nothing to do", report.experts, per_device.join(", "));
    } else {
        println!(
            "copied {} experts into {} files ({} written, {} kept) in {:.2} s: {}",
            report.experts,
            report.devices.len(),
            fmt_gb(report.written_bytes),
            report.kept,
            report.seconds,
            per_device.join(", ")
        );
    }
    Ok(())
}

/// `--verify`: every unit and every expert; prints the summary, and each mismatch to stderr.
fn verify_everything(args: &PackArgs, cfg: &Config, index: &CheckpointIndex) -> anyhow::Result<()> {
    let m = Manifest::load(&args.out)?;
    m.check_source(&args.out, &args.model, index)?;
    let progress = bar("verifying");
    progress.set_length(verify_bytes(&m, index));
    let report = verify(&args.out, &m, index, 2 * cfg.hidden_size, &|n| progress.inc(n))?;
    progress.finish_and_clear();
    let what = format!(
        "{} trunk units ({}, against their checksums and the shards) and {} experts ({}, against \
         their checksums)",
        report.units,
        fmt_gb(report.unit_bytes),
        report.experts,
        fmt_gb(report.expert_bytes)
    );
    if report.mismatches.is_empty() {
        println!("verified {what}: every one matches");
        return Ok(());
    }
    println!("verified {what}: {} mismatch(es)", report.mismatches.len());
    for m in report.mismatches.iter().take(MISMATCHES_SHOWN) {
        eprintln!("k3ring: mismatch: {m}");
    }
    if report.mismatches.len() > MISMATCHES_SHOWN {
        eprintln!("k3ring: ... and {} more", report.mismatches.len() - MISMATCHES_SHOWN);
    }
    report.into_result(&args.out)?;
    Ok(())
}
