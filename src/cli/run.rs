//! `k3ring run`: generate from a prompt, streaming tokens to stdout, then a summary.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

use super::RunArgs;
use crate::engine::{open_resident, peak_rss_bytes, GenerateOptions, Sampling};
use crate::error::UsageError;
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Serialize)]
struct RunReport<'a> {
    model: String,
    isa: &'a str,
    threads: usize,
    prompt_ids: &'a [u32],
    generated_ids: &'a [u32],
    text: String,
    prefill_seconds: f64,
    seconds_per_token: f64,
    peak_rss_bytes: Option<u64>,
    stopped_on_eos: bool,
}

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    let kernels = super::kernels_for(&args.isa)?;
    let model_dir: PathBuf = match &args.model {
        Some(dir) => dir.clone(),
        None => super::embedded::tiny_model_dir()?,
    };
    let opened = open_resident(&model_dir, args.threads, kernels)
        .with_context(|| format!("opening model {}", model_dir.display()))?;
    let (engine, tok) = (&opened.engine, &opened.tokenizer);
    let prompt = prompt_ids(args, tok)?;
    let cfg = &engine.model.cfg;
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        return Err(UsageError(format!("--ids: token {bad} is outside the vocabulary of {}", cfg.vocab_size)).into());
    }
    let mut stop_ids = Vec::new();
    if !args.ignore_eos {
        stop_ids.push(cfg.eos_token_id);
        stop_ids.extend(tok.added_id("[EOS]"));
    }
    let opts = GenerateOptions {
        gen: args.gen,
        sampling: Sampling {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop_ids,
        full_recompute: args.full_recompute,
        prefill_chunk: args.prefill_chunk,
        keep_logits: false,
    };
    let mut stream = StreamDecoder::default();
    let mut stdout = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let generation = engine.generate(&prompt, &opts, |id| {
        let piece = stream.push(tok, id).unwrap_or_else(|_| format!("<{id}>"));
        if write_err.is_none() {
            if let Err(e) = stdout.write_all(piece.as_bytes()).and_then(|()| stdout.flush()) {
                write_err = Some(e);
            }
        }
    })?;
    let tail = stream.finish();
    let _ = writeln!(stdout, "{tail}");
    drop(stdout);
    if let Some(e) = write_err.filter(|e| e.kind() != std::io::ErrorKind::BrokenPipe) {
        return Err(e).context("writing tokens to stdout");
    }
    let peak = peak_rss_bytes();
    eprintln!(
        "k3ring: {} prompt + {} generated tokens | prefill {:.3} s | decode {:.4} s/token | peak RSS {} | {} threads, {} kernels",
        generation.prompt_ids.len(),
        generation.generated_ids.len(),
        generation.prefill_seconds,
        generation.seconds_per_token,
        peak.map_or_else(|| "unknown".to_owned(), |b| format!("{:.1} MiB", b as f64 / 1048576.0)),
        engine.threads(),
        engine.model.kernels.isa().name(),
    );
    if let Some(path) = &args.json {
        let report = RunReport {
            model: model_dir.display().to_string(),
            isa: engine.model.kernels.isa().name(),
            threads: engine.threads(),
            prompt_ids: &generation.prompt_ids,
            generated_ids: &generation.generated_ids,
            text: tok.decode(&generation.generated_ids)?,
            prefill_seconds: generation.prefill_seconds,
            seconds_per_token: generation.seconds_per_token,
            peak_rss_bytes: peak,
            stopped_on_eos: generation.stopped_on.is_some(),
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
}

fn prompt_ids(args: &RunArgs, tok: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    let mut ids = Vec::new();
    if args.bos {
        ids.extend(tok.added_id("[BOS]"));
    }
    if let Some(list) = &args.ids {
        ids.extend_from_slice(list);
    } else {
        let text = match (&args.prompt, &args.prompt_file) {
            (Some(t), _) => t.clone(),
            (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("reading --prompt-file {}", f.display()))?,
            (None, None) => return Err(UsageError("give --prompt, --prompt-file or --ids".into()).into()),
        };
        ids.extend(tok.encode_with_added(&text)?);
    }
    if ids.is_empty() {
        return Err(UsageError("the prompt encodes to zero tokens".into()).into());
    }
    Ok(ids)
}
