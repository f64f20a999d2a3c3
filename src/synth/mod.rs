//! `k3ring synth`: writes a seeded random checkpoint in the released K3 layout (spec sections
//! 1-4), at the real widths or scaled down, for benches and end-to-end tests without the 1.56 TB
//! release.
//!
//! What it owns: the choice of dims ([`SynthDims`], [`SynthOptions`]), the config and tokenizer
//! files ([`synth_config`]), the shard layout (`layout`), the weight values (`fill`) and the
//! parallel writer. Every byte is a pure function of the options: each tensor has its own
//! counter-based stream keyed by (seed, tensor name), so the output does not depend on the thread
//! count or the order segments are written in. Runs on the caller's thread plus scoped writer
//! threads (`write`); allocates the plan up front and one 8 MiB segment buffer per writer.
//!
//! An output directory holds `synth.json` (the options and file list). It is written first with
//! `complete: false` and rewritten last with `complete: true`, so an interrupted run is still
//! recognised as ours and a rerun with the same options on a complete output does nothing.
#![forbid(unsafe_code)]

mod files;
mod fill;
mod layout;
mod write;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::exit::{Classify, ExitCode};

pub use files::synth_config;

/// Name of the marker file an output directory carries.
pub const MARKER_FILE: &str = "synth.json";
/// Bumped whenever the bytes for given options change, so old outputs are regenerated.
pub const GENERATOR_VERSION: u32 = 1;
/// Largest shard the writer makes (except a single tensor larger than this, which gets its own).
pub const SHARD_BYTES_MAX: u64 = 4_000_000_000;
/// Limits on the options: the release's 93 layers with room for deeper tests, its 896 experts
/// with room, and a vocabulary bound the tokenizer reader accepts comfortably.
pub const LAYERS_MAX: usize = 128;
pub const EXPERTS_MAX: usize = 1024;
pub const VOCAB_MAX: usize = 262_144;
/// Added tokens after the BPE ranks (spec 6).
pub const ADDED_TOKENS: usize = 256;
/// MXFP4 group size (spec 4): MXFP4 contraction widths must be multiples of it.
pub const MXFP4_GROUP: usize = 32;

/// Why synth refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// A bad option; `flag` names it (`--experts`, `--dims`, ...).
    #[error("{flag}: {message}")]
    Options { flag: &'static str, message: String },
    #[error(
        "{} is not empty and holds no {MARKER_FILE} from an earlier `k3ring synth`; refusing to overwrite it: choose a new or empty --out directory",
        .dir.display()
    )]
    NotEmpty { dir: PathBuf },
    #[error("cannot {op} {}: {source}", .path.display())]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("internal error: {0}")]
    Internal(String),
}

/// The documented exit code: 2 for refused options or directory, 4 for I/O, 1 for a bug.
impl Classify for SynthError {
    fn exit_code(&self) -> ExitCode {
        match self {
            SynthError::Options { .. } | SynthError::NotEmpty { .. } => ExitCode::Usage,
            SynthError::Io { .. } => ExitCode::Io,
            SynthError::Internal(_) => ExitCode::Internal,
        }
    }
}

pub(crate) fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SynthError {
    let path = path.to_owned();
    move |source| SynthError::Io { op, path, source }
}

fn bad(flag: &'static str, message: String) -> SynthError {
    SynthError::Options { flag, message }
}

/// Named width presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DimsPreset {
    /// The release's widths.
    K3,
    /// The release's widths divided by 4 (head dims kept).
    Small,
    /// The sizes of `tests/fixtures/tiny-k3`.
    Tiny,
}

impl DimsPreset {
    pub const NAMES: [&'static str; 3] = ["k3", "small", "tiny"];

    pub fn from_name(name: &str) -> Result<DimsPreset, SynthError> {
        match name {
            "k3" => Ok(DimsPreset::K3),
            "small" => Ok(DimsPreset::Small),
            "tiny" => Ok(DimsPreset::Tiny),
            _ => Err(bad("--dims", format!("{name:?} is unknown; choose from: {}", DimsPreset::NAMES.join(", ")))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DimsPreset::K3 => "k3",
            DimsPreset::Small => "small",
            DimsPreset::Tiny => "tiny",
        }
    }
}

/// Widths of the model (spec 2 names in comments). Public so benches can build other shapes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SynthDims {
    pub hidden_size: usize,       // D
    pub intermediate_size: usize, // dense FFN width of layer 0
    pub kda_heads: usize,
    pub kda_head_dim: usize, // K = V
    pub mla_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub moe_intermediate_size: usize,     // F, MXFP4 contraction width of w2
    pub routed_expert_hidden_size: usize, // LAT, MXFP4 contraction width of w1/w3
    pub n_shared_experts: usize,
}

impl SynthDims {
    pub fn preset(p: DimsPreset) -> SynthDims {
        match p {
            DimsPreset::K3 => SynthDims {
                hidden_size: 7168,
                intermediate_size: 33792,
                kda_heads: 96,
                kda_head_dim: 128,
                mla_heads: 96,
                q_lora_rank: 1536,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                moe_intermediate_size: 3072,
                routed_expert_hidden_size: 3584,
                n_shared_experts: 2,
            },
            DimsPreset::Small => SynthDims {
                hidden_size: 1792,
                intermediate_size: 8448,
                kda_heads: 24,
                kda_head_dim: 128,
                mla_heads: 24,
                q_lora_rank: 384,
                kv_lora_rank: 128,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                moe_intermediate_size: 768,
                routed_expert_hidden_size: 896,
                n_shared_experts: 2,
            },
            DimsPreset::Tiny => SynthDims {
                hidden_size: 64,
                intermediate_size: 96,
                kda_heads: 3,
                kda_head_dim: 16,
                mla_heads: 4,
                q_lora_rank: 32,
                kv_lora_rank: 32,
                qk_nope_head_dim: 16,
                qk_rope_head_dim: 8,
                v_head_dim: 16,
                moe_intermediate_size: 32,
                routed_expert_hidden_size: 64,
                n_shared_experts: 2,
            },
        }
    }
}

/// Everything that decides the output's bytes, plus where it goes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SynthOptions {
    /// Output directory (not part of the identity of an output).
    #[serde(skip)]
    pub out: PathBuf,
    /// The preset the dims came from (recorded; the dims below are what counts).
    pub preset: DimsPreset,
    pub dims: SynthDims,
    pub layers: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Total vocabulary: BPE ranks plus the 256 added tokens.
    pub vocab: usize,
    pub attn_res_block_size: usize,
    pub seed: u64,
    /// How predictable routing is, in [0, 1] (the formula is in `fill.rs`'s module doc): 0 is
    /// the nearly flat routing of generator version 1. Left out of the marker when 0, so an
    /// output written before this option existed still matches its options byte for byte.
    #[serde(skip_serializing_if = "is_zero")]
    pub routing_locality: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// The attention-residual block size for a layer count: 12 as in K3, but small enough that a
/// short model still has at least two blocks.
pub fn default_block_size(preset: DimsPreset, layers: usize) -> usize {
    match preset {
        DimsPreset::Tiny => 3,
        DimsPreset::K3 | DimsPreset::Small => (layers / 3).clamp(2, 12),
    }
}

impl SynthOptions {
    /// The defaults of a preset.
    pub fn preset(out: PathBuf, preset: DimsPreset) -> SynthOptions {
        let (layers, experts, top_k, vocab) = match preset {
            DimsPreset::K3 => (6, 64, 16, 8192),
            DimsPreset::Small => (8, 64, 16, 8192),
            DimsPreset::Tiny => (13, 16, 4, 768),
        };
        SynthOptions {
            out,
            preset,
            dims: SynthDims::preset(preset),
            layers,
            experts,
            top_k,
            vocab,
            attn_res_block_size: default_block_size(preset, layers),
            seed: 0,
            routing_locality: 0.0,
        }
    }

    /// The CLI path: a preset name plus overrides, validated.
    #[allow(clippy::too_many_arguments)]
    pub fn from_flags(
        out: PathBuf,
        dims: &str,
        layers: Option<usize>,
        experts: Option<usize>,
        top_k: Option<usize>,
        vocab: Option<usize>,
        seed: u64,
        routing_locality: f64,
    ) -> Result<SynthOptions, SynthError> {
        let preset = DimsPreset::from_name(dims)?;
        let mut o = SynthOptions::preset(out, preset);
        if let Some(n) = layers {
            o.layers = n;
            o.attn_res_block_size = default_block_size(preset, n);
        }
        o.experts = experts.unwrap_or(o.experts);
        o.top_k = top_k.unwrap_or(o.top_k);
        o.vocab = vocab.unwrap_or(o.vocab);
        o.seed = seed;
        // + 0.0 turns -0 into 0, so `--routing-locality -0` is recorded and reported as 0.
        o.routing_locality = routing_locality + 0.0;
        o.validate()?;
        Ok(o)
    }

    /// Refuses options that cannot make a valid checkpoint, naming the flag.
    pub fn validate(&self) -> Result<(), SynthError> {
        if !(2..=LAYERS_MAX).contains(&self.layers) {
            return Err(bad(
                "--layers",
                format!("{} is outside 2..={LAYERS_MAX} (layer 0 is dense; MoE needs a second)", self.layers),
            ));
        }
        if !(2..=EXPERTS_MAX).contains(&self.experts) {
            return Err(bad("--experts", format!("{} is outside 2..={EXPERTS_MAX}", self.experts)));
        }
        if self.top_k == 0 {
            return Err(bad("--top-k", "must be at least 1".to_owned()));
        }
        if self.experts < self.top_k {
            return Err(bad(
                "--experts",
                format!("{} is fewer than --top-k {}: raise --experts or lower --top-k", self.experts, self.top_k),
            ));
        }
        if !(2 * ADDED_TOKENS..=VOCAB_MAX).contains(&self.vocab) {
            return Err(bad(
                "--vocab",
                format!(
                    "{} is outside {}..={VOCAB_MAX} (256 byte ranks plus 256 added tokens at least)",
                    self.vocab,
                    2 * ADDED_TOKENS
                ),
            ));
        }
        // Written as a negated range test so that NaN is refused too.
        if !(0.0..=1.0).contains(&self.routing_locality) {
            return Err(bad(
                "--routing-locality",
                format!(
                    "{} is outside 0..=1 (0: flat routing as before, 1: the most predictable)",
                    self.routing_locality
                ),
            ));
        }
        if self.attn_res_block_size == 0 {
            return Err(bad("--layers", "the attention-residual block size must be positive".to_owned()));
        }
        self.validate_dims()
    }

    fn validate_dims(&self) -> Result<(), SynthError> {
        let d = &self.dims;
        for (name, width) in [
            ("moe_intermediate_size (F)", d.moe_intermediate_size),
            ("routed_expert_hidden_size (LAT)", d.routed_expert_hidden_size),
        ] {
            if width == 0 || width % MXFP4_GROUP != 0 {
                return Err(bad(
                    "--dims",
                    format!("{name} = {width} is not a positive multiple of the MXFP4 group {MXFP4_GROUP}"),
                ));
            }
        }
        let positive = [
            d.hidden_size,
            d.intermediate_size,
            d.kda_heads,
            d.kda_head_dim,
            d.mla_heads,
            d.q_lora_rank,
            d.kv_lora_rank,
            d.qk_nope_head_dim,
            d.v_head_dim,
        ];
        if positive.contains(&0) {
            return Err(bad("--dims", format!("every width must be positive: {d:?}")));
        }
        Ok(())
    }

    /// BPE ranks: the vocabulary minus the added tokens.
    pub fn n_ranks(&self) -> usize {
        self.vocab - ADDED_TOKENS
    }
}

/// What a synth run did.
#[derive(Clone, Debug, Serialize)]
pub struct SynthReport {
    pub out: PathBuf,
    pub dims: DimsPreset,
    pub layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub vocab: usize,
    pub seed: u64,
    pub routing_locality: f64,
    /// The directory already held a complete output for these options; nothing was written.
    pub up_to_date: bool,
    pub shards: usize,
    pub tensors: usize,
    /// Bytes of every file of the output (shards, index, config, tokenizer).
    pub bytes: u64,
    pub seconds: f64,
    /// 10^6 bytes per second over `seconds` (generation, writes and the final fsync).
    pub mb_per_s: f64,
}

/// One file of an output, as the marker records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct MarkerFile {
    name: String,
    bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Marker {
    format: String,
    version: u32,
    complete: bool,
    options: serde_json::Value,
    files: Vec<MarkerFile>,
}

const MARKER_FORMAT: &str = "k3ring-synth";

/// Writes the checkpoint described by `opts` into `opts.out`. `progress(done, total)` is called
/// with shard bytes from worker threads as segments land.
pub fn synth(opts: &SynthOptions, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<SynthReport, SynthError> {
    let start = std::time::Instant::now();
    opts.validate()?;
    let config_value = synth_config(opts);
    let cfg = crate::config::Config::from_json_str(&config_value.to_string(), Path::new("synth config"))
        .map_err(|e| SynthError::Internal(format!("the synthesized config does not validate: {e}")))?;
    let shards = layout::plan(&cfg, opts)?;
    let small = files::small_files(opts, &config_value, &shards)?;
    let mut listed: Vec<MarkerFile> =
        small.iter().map(|(name, bytes)| MarkerFile { name: name.clone(), bytes: bytes.len() as u64 }).collect();
    listed.extend(shards.iter().map(|s| MarkerFile { name: s.file_name.clone(), bytes: s.file_len() }));
    let tensors = shards.iter().map(|s| s.tensors.len()).sum();
    let bytes: u64 = listed.iter().map(|f| f.bytes).sum();
    let mut options = serde_json::to_value(opts).map_err(|e| SynthError::Internal(e.to_string()))?;
    options.sort_all_objects();
    let report = |up_to_date: bool, seconds: f64| SynthReport {
        out: opts.out.clone(),
        dims: opts.preset,
        layers: opts.layers,
        experts: opts.experts,
        top_k: opts.top_k,
        vocab: opts.vocab,
        seed: opts.seed,
        routing_locality: opts.routing_locality,
        up_to_date,
        shards: shards.len(),
        tensors,
        bytes,
        seconds,
        mb_per_s: bytes as f64 / 1e6 / seconds.max(1e-9),
    };
    if prepare_dir(&opts.out, &options, &listed)? {
        return Ok(report(true, start.elapsed().as_secs_f64()));
    }
    let mut marker = Marker {
        format: MARKER_FORMAT.to_owned(),
        version: GENERATOR_VERSION,
        complete: false,
        options,
        files: listed,
    };
    write_marker(&opts.out, &marker)?;
    for (name, content) in &small {
        write::write_small(&opts.out.join(name), content)?;
    }
    write::write_shards(&opts.out, &shards, progress)?;
    marker.complete = true;
    write_marker(&opts.out, &marker)?;
    write::sync_dir(&opts.out)?;
    Ok(report(false, start.elapsed().as_secs_f64()))
}

/// Creates `dir` or checks it may be written. Returns true when it already holds a complete
/// output of these options (every listed file present with its size). Otherwise removes the
/// files an earlier synth output listed, so stale shards of another shard count do not linger.
fn prepare_dir(dir: &Path, options: &serde_json::Value, files: &[MarkerFile]) -> Result<bool, SynthError> {
    std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let mut entries = std::fs::read_dir(dir).map_err(io_err("list", dir))?;
    if entries.next().is_none() {
        return Ok(false);
    }
    let marker_path = dir.join(MARKER_FILE);
    let old: Marker = match std::fs::read(&marker_path) {
        Ok(text) => match serde_json::from_slice::<Marker>(&text) {
            Ok(m) if m.format == MARKER_FORMAT => m,
            _ => return Err(SynthError::NotEmpty { dir: dir.to_owned() }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(SynthError::NotEmpty { dir: dir.to_owned() }),
        Err(e) => return Err(SynthError::Io { op: "read", path: marker_path, source: e }),
    };
    let same = old.complete && old.version == GENERATOR_VERSION && &old.options == options && old.files == files;
    if same && files.iter().all(|f| std::fs::metadata(dir.join(&f.name)).is_ok_and(|m| m.len() == f.bytes)) {
        return Ok(true);
    }
    for f in old.files.iter().filter(|f| files::is_output_name(&f.name)) {
        let path = dir.join(&f.name);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(SynthError::Io { op: "remove", path, source: e }),
        }
    }
    Ok(false)
}

fn write_marker(dir: &Path, marker: &Marker) -> Result<(), SynthError> {
    let text = serde_json::to_vec_pretty(marker).map_err(|e| SynthError::Internal(e.to_string()))?;
    let tmp = dir.join(format!("{MARKER_FILE}.tmp"));
    write::write_small(&tmp, &text)?;
    let path = dir.join(MARKER_FILE);
    std::fs::rename(&tmp, &path).map_err(io_err("rename", &tmp))
}
