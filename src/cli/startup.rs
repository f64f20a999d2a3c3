//! The start-up every generating subcommand (`run`, `batch`, `chat`, and any later one that opens
//! a model the same way) shares, in one place so the commands cannot drift apart: the kernels
//! `--isa` names, the refusal of streaming flags without `--trunk`, the Ctrl-C handler, the model
//! directory (or the embedded tiny model) and the placement, printed and done with
//! `--print-placement`.

use std::path::{Path, PathBuf};

use super::pipeline_flags::PipelineArgs;
use crate::pipeline::Placement;

/// The flags start-up reads; every generating subcommand has them.
#[derive(Clone, Copy, Debug)]
pub struct StartupFlags<'a> {
    /// `--isa`.
    pub isa: &'a str,
    /// `--model`; `None` for the embedded tiny model.
    pub model: Option<&'a Path>,
    /// `--trunk` given: a streaming run.
    pub streaming: bool,
    /// Ids of the flags given on the command line (see `given_ids`).
    pub given: &'a [String],
    pub pipeline: &'a PipelineArgs,
    /// `--threads`.
    pub threads: usize,
}

/// The [`StartupFlags`] of a subcommand's arguments: every generating subcommand names these
/// fields alike (`isa`, `model`, `storage.trunk`, `given`, `pipeline`, `threads`), so one
/// definition reads them for all.
macro_rules! startup_flags {
    ($args:expr) => {
        $crate::cli::startup::StartupFlags {
            isa: &$args.isa,
            model: $args.model.as_deref(),
            streaming: $args.storage.trunk.is_some(),
            given: &$args.given,
            pipeline: &$args.pipeline,
            threads: $args.threads,
        }
    };
}
pub(super) use startup_flags;

/// What start-up resolved.
#[derive(Debug)]
pub struct Started {
    pub kernels: kernels::Kernels,
    pub model_dir: PathBuf,
    /// Resolved for streaming runs only (a resident run does not pin threads).
    pub placement: Option<Placement>,
}

/// Runs the shared start-up. `Ok(None)`: `--print-placement` printed the placement and the
/// command has nothing more to do (exit 0).
pub fn start_up(flags: &StartupFlags<'_>) -> anyhow::Result<Option<Started>> {
    let kernels = super::kernels_for(flags.isa)?;
    let print = flags.pipeline.print_placement;
    if !flags.streaming && !print {
        super::run::refuse_streaming_flags(flags.given)?;
    }
    if let Err(e) = crate::interrupt::install_sigint_handler() {
        tracing::warn!("cannot handle Ctrl-C ({e}); it will end the run without a summary");
    }
    let model_dir = match flags.model {
        Some(dir) => dir.to_path_buf(),
        None => super::embedded::tiny_model_dir()?,
    };
    let placement = if flags.streaming || print { Some(flags.pipeline.placement(flags.threads)?) } else { None };
    if let (true, Some(p)) = (print, &placement) {
        println!("{}", p.describe());
        return Ok(None);
    }
    Ok(Some(Started { kernels, model_dir, placement }))
}
