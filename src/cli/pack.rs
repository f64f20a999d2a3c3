//! `k3ring pack`: write the trunk pack for streaming, with a progress bar.

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::PackArgs;
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::storage::pack::{write_pack, Manifest};

pub fn run(args: &PackArgs) -> anyhow::Result<()> {
    let cfg = Config::from_model_dir(&args.model)?;
    let index = CheckpointIndex::open(&args.model).with_context(|| format!("indexing {}", args.model.display()))?;
    index.validate(&cfg)?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} packing trunk [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let report = write_pack(&args.model, &cfg, &index, &args.out, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    if report.up_to_date {
        println!(
            "trunk pack in {} is up to date ({} units, {:.1} MiB); nothing to do",
            args.out.display(),
            report.units,
            report.bytes as f64 / 1048576.0
        );
    } else {
        println!(
            "packed {} tensors in {} units into {} ({:.1} MiB, units aligned to {} bytes) in {:.2} s ({:.0} MiB/s)",
            report.tensors,
            report.units,
            args.out.display(),
            report.bytes as f64 / 1048576.0,
            report.alignment,
            report.seconds,
            report.bytes as f64 / 1048576.0 / report.seconds.max(1e-9)
        );
    }
    if args.verify {
        let m = Manifest::load(&args.out)?;
        m.check_source(&args.out, &args.model, &index)?;
        m.verify_all(&args.out)?;
        println!("verified: every unit matches its checksum");
    }
    Ok(())
}
