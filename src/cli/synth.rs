//! `k3ring synth`: write a seeded random checkpoint in the release layout, with a progress bar.

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};

use crate::synth::{synth, SynthOptions, SynthReport};

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct SynthArgs {
    /// Output directory (new, empty, or an earlier synth output).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Widths: k3 (the release), small (k3 / 4) or tiny (the test fixture).
    #[arg(long, value_name = "DIMS", default_value = "k3")]
    pub dims: String,
    /// Decoder layers [default: 6 k3, 8 small, 13 tiny].
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Routed experts per MoE layer [default: 64 k3/small, 16 tiny].
    #[arg(long, value_name = "E")]
    pub experts: Option<usize>,
    /// Experts per token [default: 16 k3/small, 4 tiny].
    // `--topk` was this flag's spelling; kept, hidden, so old scripts keep working.
    #[arg(long = "top-k", alias = "topk", value_name = "K")]
    pub top_k: Option<usize>,
    /// Vocabulary incl. 256 added tokens [default: 8192 k3/small, 768 tiny].
    #[arg(long, value_name = "V")]
    pub vocab: Option<usize>,
    /// Seed of every weight and of the tokenizer.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// How predictable routing is, 0 to 1: the next layer's experts from this layer's hidden
    /// state, and the experts of consecutive tokens (0: flat, unpredictable routing).
    #[arg(long, value_name = "X", default_value_t = 0.0)]
    pub routing_locality: f64,
    /// Write the summary as JSON to FILE ("-": to stdout, instead of the text).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

pub fn run(args: &SynthArgs) -> anyhow::Result<()> {
    let json = super::output::JsonOut::open(args.json.as_deref())?;
    let opts = SynthOptions::from_flags(
        args.out.clone(),
        &args.dims,
        args.layers,
        args.experts,
        args.top_k,
        args.vocab,
        args.seed,
        args.routing_locality,
    )?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} synth [{bar:40}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let report = synth(&opts, &|done, total| {
        if bar.length() != Some(total) {
            bar.set_length(total);
        }
        // Workers report out of order; keep the bar monotonic.
        if done > bar.position() {
            bar.set_position(done);
        }
    })?;
    bar.finish_and_clear();
    if !super::output::JsonOut::is_stdout(json.as_ref()) {
        print_text(&report);
    }
    if let Some(out) = &json {
        out.write(&report)?;
    }
    Ok(())
}

fn print_text(r: &SynthReport) {
    let mut what = format!(
        "{} dims, {} layers, {} experts, top-{}, vocab {}, seed {}",
        r.dims.name(),
        r.layers,
        r.experts,
        r.top_k,
        r.vocab,
        r.seed
    );
    if r.routing_locality != 0.0 {
        what += &format!(", routing locality {}", r.routing_locality);
    }
    if r.up_to_date {
        println!("{} already holds this checkpoint ({what}); nothing to do", r.out.display());
        return;
    }
    println!(
        "wrote {} ({what}): {:.2} GB in {} shards, {} tensors, {:.2} s, {:.2} GB/s",
        r.out.display(),
        r.bytes as f64 / 1e9,
        r.shards,
        r.tensors,
        r.seconds,
        r.mb_per_s / 1e3
    );
}
