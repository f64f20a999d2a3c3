//! The strict reader of `config.json` (spec section 2).
//!
//! Two stages, as the house style asks: the JSON is read into [`RawConfig`] by a collector that
//! records *every* missing or ill-typed key before failing, so a user fixes a broken config in one
//! round trip; [`Config::validate`] then checks the structure (layer lists, top-k, MXFP4 group
//! size, head dims) and derives the layer plan. Unsupported variants are refused here, at load,
//! never in the forward pass. Runs once at start-up on the main thread; allocates freely.
//!
//! Files: this one holds the validated [`Config`] and its parts; [`read`] the JSON collector,
//! [`RawConfig`] and the structural checks.
#![forbid(unsafe_code)]

mod read;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use crate::exit::{Classify, ExitCode};

pub use read::RawConfig;
use read::{check_dims, check_supported, layer_plan, tokenizer_context_length};

/// Why a config was refused: exit code 2 (config refused), except [`ConfigError::Read`], which is
/// an I/O failure (4).
/// A config.json larger than this is refused unread (release configs are a few KB).
pub const CONFIG_BYTES_MAX: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read (exit 4).
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: missing or ill-typed keys: {}", .problems.join("; "))]
    Keys { path: PathBuf, problems: Vec<String> },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: unsupported model variant: {message}")]
    Unsupported { path: PathBuf, message: String },
    /// Not a regular file, or larger than any config (exit 3).
    #[error(transparent)]
    Input(#[from] crate::files::InputError),
}

impl Classify for ConfigError {
    fn exit_code(&self) -> ExitCode {
        match self {
            ConfigError::Read { .. } => ExitCode::Io,
            ConfigError::Json { .. }
            | ConfigError::Keys { .. }
            | ConfigError::Invalid { .. }
            | ConfigError::Unsupported { .. } => ExitCode::Usage,
            ConfigError::Input(e) => e.exit_code(),
        }
    }
}

/// Attention kind of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum AttnKind {
    /// Kimi Delta Attention (linear attention with a carried state).
    Kda,
    /// Gated multi-head latent attention (full attention over a latent cache).
    Mla,
}

/// Feed-forward kind of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FfnKind {
    /// The dense SiTU-GLU MLP of the first layers.
    Dense,
    /// Latent mixture of experts plus shared experts.
    Moe,
}

/// What the forward pass does at one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerPlan {
    pub attn: AttnKind,
    pub ffn: FfnKind,
    /// The layer snapshots its input and restarts the partial sum (spec 5, step 2).
    pub block_start: bool,
}

/// KDA dimensions (`text_config.linear_attn_config`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KdaConfig {
    pub n_heads: usize,
    /// K = V: key and value dims per head.
    pub head_dim: usize,
    pub conv_kernel_size: usize,
    pub gate_lower_bound: f32,
}

impl KdaConfig {
    /// Width of the q, k, v, g projections: heads x head_dim.
    pub fn width(&self) -> usize {
        self.n_heads * self.head_dim
    }
}

/// Gated MLA dimensions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MlaConfig {
    pub n_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

impl MlaConfig {
    /// Query/key dims per head: nope then the head-shared dims.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Attention score scale: qk_head_dim^-0.5 (192 in K3, not 128: a spec trap).
    pub fn softmax_scale(&self) -> f32 {
        1.0 / (self.qk_head_dim() as f32).sqrt()
    }
    /// Values cached per position: normalised latent plus the shared dims.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// Latent MoE dimensions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MoeConfig {
    pub n_experts: usize,
    pub top_k: usize,
    pub n_shared_experts: usize,
    /// F: expert hidden width.
    pub expert_hidden: usize,
    /// LAT: width of the latent the routed experts act on.
    pub latent: usize,
    pub routed_scaling_factor: f32,
}

impl MoeConfig {
    /// Width of the fused shared-expert MLP.
    pub fn shared_hidden(&self) -> usize {
        self.n_shared_experts * self.expert_hidden
    }
}

/// A validated K3 text config with its derived layer plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: Option<u32>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub dense_intermediate: usize,
    pub rms_norm_eps: f32,
    pub situ_beta: f32,
    /// Up-branch cap; `None` means uncapped.
    pub situ_linear_beta: Option<f32>,
    pub attn_res_block_size: usize,
    pub mxfp4_group_size: usize,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    pub moe: MoeConfig,
    pub layers: Vec<LayerPlan>,
    /// Positions the model supports (prompt plus generated tokens), when the files state it.
    pub context_length: Option<ContextLength>,
}

/// The model's context length and the key it came from, for messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ContextLength {
    pub positions: usize,
    /// E.g. `text_config.max_position_embeddings in config.json`.
    pub source: String,
}

/// Keys that state the context length in config.json, first found wins (the text config's, then
/// the top level's).
const CONTEXT_KEYS: [&str; 2] = ["max_position_embeddings", "model_max_length"];

/// Above this a `model_max_length` in tokenizer_config.json is the "unset" placeholder that
/// tokenizer libraries write (often 1e30), not a context length.
const TOKENIZER_CONTEXT_MAX: u64 = 1 << 40;

/// The RMSNorm eps of the two MLA latent norms: 1e-6 in the release code (spec 5).
pub const MLA_LATENT_NORM_EPS: f32 = 1e-6;
/// Eps inside the attention-residual read's RMS (spec 5).
pub const ATTN_RES_EPS: f32 = 1e-5;

impl Config {
    /// Reads and validates `DIR/config.json`. Without a context length there, the
    /// `model_max_length` of `DIR/tokenizer_config.json` is used when it is a real one.
    pub fn from_model_dir(dir: &Path) -> Result<Config, ConfigError> {
        let mut cfg = Config::from_file(&dir.join("config.json"))?;
        if cfg.context_length.is_none() {
            cfg.context_length = tokenizer_context_length(&dir.join("tokenizer_config.json"));
        }
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let bytes =
            crate::files::input::read_regular(path, CONFIG_BYTES_MAX, "a config.json").map_err(|e| match e {
                crate::files::InputError::Io { path, source, .. } => ConfigError::Read { path, source },
                e => ConfigError::Input(e),
            })?;
        Config::from_json_bytes(&bytes, path)
    }

    /// Parses config text; `path` only names the source in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Config, ConfigError> {
        Config::from_json_bytes(text.as_bytes(), path)
    }

    /// Parses the bytes of a config file; invalid UTF-8 is invalid JSON (exit 2), not an I/O
    /// failure. `path` only names the source in errors.
    pub fn from_json_bytes(bytes: &[u8], path: &Path) -> Result<Config, ConfigError> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|source| ConfigError::Json { path: path.to_owned(), source })?;
        let raw =
            RawConfig::from_value(&value).map_err(|problems| ConfigError::Keys { path: path.to_owned(), problems })?;
        Config::validate(raw, path)
    }

    /// Structural checks and the derived layer plan.
    pub fn validate(raw: RawConfig, path: &Path) -> Result<Config, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid { path: path.to_owned(), message };
        let unsupported = |message: String| ConfigError::Unsupported { path: path.to_owned(), message };
        check_supported(&raw).map_err(unsupported)?;
        check_dims(&raw).map_err(invalid)?;
        let layers = layer_plan(&raw).map_err(invalid)?;
        Ok(Config {
            bos_token_id: raw.bos_token_id,
            eos_token_id: raw.eos_token_id,
            pad_token_id: raw.pad_token_id,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            n_layers: raw.num_hidden_layers,
            dense_intermediate: raw.intermediate_size,
            rms_norm_eps: raw.rms_norm_eps,
            situ_beta: raw.activation_situ_beta,
            situ_linear_beta: raw.activation_situ_linear_beta,
            attn_res_block_size: raw.attn_res_block_size,
            mxfp4_group_size: raw.group_size,
            kda: KdaConfig {
                n_heads: raw.kda_num_heads,
                head_dim: raw.kda_head_dim,
                conv_kernel_size: raw.short_conv_kernel_size,
                gate_lower_bound: raw.gate_lower_bound,
            },
            mla: MlaConfig {
                n_heads: raw.num_attention_heads,
                q_lora_rank: raw.q_lora_rank,
                kv_lora_rank: raw.kv_lora_rank,
                qk_nope_head_dim: raw.qk_nope_head_dim,
                qk_rope_head_dim: raw.qk_rope_head_dim,
                v_head_dim: raw.v_head_dim,
            },
            moe: MoeConfig {
                n_experts: raw.num_experts,
                top_k: raw.num_experts_per_token,
                n_shared_experts: raw.num_shared_experts,
                expert_hidden: raw.moe_intermediate_size,
                latent: raw.routed_expert_hidden_size,
                routed_scaling_factor: raw.routed_scaling_factor,
            },
            layers,
            context_length: raw.context_length,
        })
    }

    /// The layer map, one letter per layer: `K` for KDA, `M` for MLA.
    pub fn layer_map(&self) -> String {
        self.layers
            .iter()
            .map(|l| match l.attn {
                AttnKind::Kda => 'K',
                AttnKind::Mla => 'M',
            })
            .collect()
    }

    /// 0-based indices of the layers that start an attention-residual block.
    pub fn block_starts(&self) -> Vec<usize> {
        (0..self.n_layers).filter(|&l| self.layers[l].block_start).collect()
    }

    /// 0-based indices of the MoE layers.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.n_layers).filter(|&l| self.layers[l].ffn == FfnKind::Moe).collect()
    }

    /// Bytes of one routed expert: three MXFP4 matrices of F x LAT weights plus E8M0 scales.
    pub fn expert_bytes(&self) -> u64 {
        let weights = (self.moe.expert_hidden * self.moe.latent) as u64;
        let per_matrix = weights / 2 + weights / self.mxfp4_group_size as u64;
        3 * per_matrix
    }
}
