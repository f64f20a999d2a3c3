//! What a K3 checkpoint must contain for a given config (spec section 3), the check of an index
//! against it, and the byte census `inspect` prints.

use serde::Serialize;

use super::experts::{expert_tensor_name, EXPERT_PARTS};
use super::{CheckpointError, CheckpointIndex, Dtype, ExpertPart, LM_HEAD, MODEL_PREFIX};
use crate::config::{AttnKind, Config, FfnKind};

/// One tensor the config requires.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpectedTensor {
    pub name: String,
    pub dtype: Dtype,
    /// Accepted shapes; the first is the canonical one.
    pub shapes: Vec<Vec<u64>>,
    /// The layer it belongs to; `None` for globals (embedding, head, final norms).
    pub layer: Option<usize>,
    /// `Some(expert)` for routed-expert tensors.
    pub expert: Option<usize>,
}

fn t(name: String, dtype: Dtype, shape: &[usize], layer: Option<usize>) -> ExpectedTensor {
    ExpectedTensor { name, dtype, shapes: vec![shape.iter().map(|&d| d as u64).collect()], layer, expert: None }
}

/// Every tensor the forward pass reads, with dtype and shape, in forward order per layer.
pub fn expected_tensors(cfg: &Config) -> Vec<ExpectedTensor> {
    let d = cfg.hidden_size;
    let v = cfg.vocab_size;
    let mut out = vec![t(format!("{MODEL_PREFIX}embed_tokens.weight"), Dtype::Bf16, &[v, d], None)];
    for (l, plan) in cfg.layers.iter().enumerate() {
        let p = format!("{MODEL_PREFIX}layers.{l}.");
        let ly = Some(l);
        for norm in ["self_attention_res_norm", "input_layernorm"] {
            out.push(t(format!("{p}{norm}.weight"), Dtype::Bf16, &[d], ly));
        }
        out.push(t(format!("{p}self_attention_res_proj.weight"), Dtype::Bf16, &[1, d], ly));
        match plan.attn {
            AttnKind::Kda => kda_tensors(cfg, &p, ly, &mut out),
            AttnKind::Mla => mla_tensors(cfg, &p, ly, &mut out),
        }
        out.push(t(format!("{p}mlp_res_norm.weight"), Dtype::Bf16, &[d], ly));
        out.push(t(format!("{p}mlp_res_proj.weight"), Dtype::Bf16, &[1, d], ly));
        out.push(t(format!("{p}post_attention_layernorm.weight"), Dtype::Bf16, &[d], ly));
        match plan.ffn {
            FfnKind::Dense => {
                let f = cfg.dense_intermediate;
                out.push(t(format!("{p}mlp.gate_proj.weight"), Dtype::Bf16, &[f, d], ly));
                out.push(t(format!("{p}mlp.up_proj.weight"), Dtype::Bf16, &[f, d], ly));
                out.push(t(format!("{p}mlp.down_proj.weight"), Dtype::Bf16, &[d, f], ly));
            }
            FfnKind::Moe => moe_tensors(cfg, l, &p, &mut out),
        }
    }
    out.push(t(format!("{MODEL_PREFIX}output_attn_res_norm.weight"), Dtype::Bf16, &[d], None));
    out.push(t(format!("{MODEL_PREFIX}output_attn_res_proj.weight"), Dtype::Bf16, &[1, d], None));
    out.push(t(format!("{MODEL_PREFIX}norm.weight"), Dtype::Bf16, &[d], None));
    out.push(t(LM_HEAD.to_owned(), Dtype::Bf16, &[v, d], None));
    out
}

fn kda_tensors(cfg: &Config, p: &str, ly: Option<usize>, out: &mut Vec<ExpectedTensor>) {
    let d = cfg.hidden_size;
    let (h, k) = (cfg.kda.n_heads, cfg.kda.head_dim);
    let w = cfg.kda.width();
    let a = format!("{p}self_attn.");
    for proj in ["q_proj", "k_proj", "v_proj"] {
        out.push(t(format!("{a}{proj}.weight"), Dtype::Bf16, &[w, d], ly));
    }
    for conv in ["q_conv1d", "k_conv1d", "v_conv1d"] {
        out.push(t(format!("{a}{conv}.weight"), Dtype::F32, &[w, 1, cfg.kda.conv_kernel_size], ly));
    }
    out.push(t(format!("{a}f_a_proj.weight"), Dtype::Bf16, &[k, d], ly));
    out.push(t(format!("{a}f_b_proj.weight"), Dtype::Bf16, &[w, k], ly));
    // The release pads A_log to the head dim (128 entries for 96 heads); accept [heads] too.
    let mut a_log = t(format!("{a}A_log"), Dtype::F32, &[h.max(k)], ly);
    if k > h {
        a_log.shapes.push(vec![h as u64]);
    }
    out.push(a_log);
    out.push(t(format!("{a}dt_bias"), Dtype::F32, &[w], ly));
    out.push(t(format!("{a}b_proj.weight"), Dtype::Bf16, &[h, d], ly));
    out.push(t(format!("{a}g_proj.weight"), Dtype::Bf16, &[w, d], ly));
    out.push(t(format!("{a}o_norm.weight"), Dtype::F32, &[k], ly));
    out.push(t(format!("{a}o_proj.weight"), Dtype::Bf16, &[d, w], ly));
}

fn mla_tensors(cfg: &Config, p: &str, ly: Option<usize>, out: &mut Vec<ExpectedTensor>) {
    let d = cfg.hidden_size;
    let m = &cfg.mla;
    let a = format!("{p}self_attn.");
    out.push(t(format!("{a}q_a_proj.weight"), Dtype::Bf16, &[m.q_lora_rank, d], ly));
    out.push(t(format!("{a}q_a_layernorm.weight"), Dtype::Bf16, &[m.q_lora_rank], ly));
    out.push(t(format!("{a}q_b_proj.weight"), Dtype::Bf16, &[m.n_heads * m.qk_head_dim(), m.q_lora_rank], ly));
    out.push(t(format!("{a}kv_a_proj_with_mqa.weight"), Dtype::Bf16, &[m.cache_width(), d], ly));
    out.push(t(format!("{a}kv_a_layernorm.weight"), Dtype::Bf16, &[m.kv_lora_rank], ly));
    let kv_b_rows = m.n_heads * (m.qk_nope_head_dim + m.v_head_dim);
    out.push(t(format!("{a}kv_b_proj.weight"), Dtype::Bf16, &[kv_b_rows, m.kv_lora_rank], ly));
    out.push(t(format!("{a}g_proj.weight"), Dtype::Bf16, &[m.n_heads * m.v_head_dim, d], ly));
    out.push(t(format!("{a}o_proj.weight"), Dtype::Bf16, &[d, m.n_heads * m.v_head_dim], ly));
}

fn moe_tensors(cfg: &Config, l: usize, p: &str, out: &mut Vec<ExpectedTensor>) {
    let d = cfg.hidden_size;
    let m = &cfg.moe;
    let (f, lat, g) = (m.expert_hidden, m.latent, cfg.mxfp4_group_size);
    let ly = Some(l);
    let b = format!("{p}block_sparse_moe.");
    out.push(t(format!("{b}gate.weight"), Dtype::Bf16, &[m.n_experts, d], ly));
    out.push(t(format!("{b}gate.e_score_correction_bias"), Dtype::F32, &[m.n_experts], ly));
    out.push(t(format!("{b}routed_expert_down_proj.weight"), Dtype::Bf16, &[lat, d], ly));
    out.push(t(format!("{b}routed_expert_norm.weight"), Dtype::Bf16, &[lat], ly));
    out.push(t(format!("{b}routed_expert_up_proj.weight"), Dtype::Bf16, &[d, lat], ly));
    let sh = m.shared_hidden();
    if sh > 0 {
        out.push(t(format!("{b}shared_experts.gate_proj.weight"), Dtype::Bf16, &[sh, d], ly));
        out.push(t(format!("{b}shared_experts.up_proj.weight"), Dtype::Bf16, &[sh, d], ly));
        out.push(t(format!("{b}shared_experts.down_proj.weight"), Dtype::Bf16, &[d, sh], ly));
    }
    for e in 0..m.n_experts {
        for part in EXPERT_PARTS {
            let shape: [usize; 2] = match part {
                ExpertPart::W1Packed | ExpertPart::W3Packed => [f, lat / 2],
                ExpertPart::W1Scale | ExpertPart::W3Scale => [f, lat / g],
                ExpertPart::W2Packed => [lat, f / 2],
                ExpertPart::W2Scale => [lat, f / g],
            };
            let mut et = t(expert_tensor_name(l, e, part), Dtype::U8, &shape, ly);
            et.expert = Some(e);
            out.push(et);
        }
    }
}

impl CheckpointIndex {
    /// The index a release checkpoint of `cfg` would have, with no file behind it: one virtual
    /// shard holding every tensor the config requires, in [`expected_tensors`] order, each at
    /// its canonical shape. For sizing (`k3ring plan`); nothing can be read through it.
    pub fn for_config(cfg: &Config) -> Result<CheckpointIndex, CheckpointError> {
        let mut at = 0u64;
        let entries = expected_tensors(cfg)
            .into_iter()
            .map(|t| {
                let shape = t.shapes.into_iter().next().unwrap_or_default();
                let len = shape.iter().product::<u64>() * t.dtype.size();
                let entry = super::safetensors::RawEntry {
                    dtype: super::safetensors::RawDtype::Known(t.dtype),
                    shape,
                    data_offsets: [at, at + len],
                };
                at += len;
                (t.name, entry)
            })
            .collect();
        let dir = std::path::PathBuf::from("(from config.json)");
        let shard = dir.join("model-00001-of-00001.safetensors");
        let header = super::safetensors::Header { file_len: at, data_start: 0, entries };
        CheckpointIndex::assemble(&dir, vec![shard], vec![header], None)
    }
}

/// Trunk and expert bytes of one layer.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LayerCensus {
    pub layer: usize,
    pub trunk_bytes: u64,
    pub expert_bytes: u64,
}

/// Where the bytes of a validated checkpoint are.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Census {
    pub layers: Vec<LayerCensus>,
    /// Embedding, head and the final norms.
    pub global_bytes: u64,
    pub trunk_bytes: u64,
    pub expert_bytes: u64,
    pub n_experts_total: usize,
    pub bytes_per_expert: u64,
    pub non_contiguous_experts: usize,
}

/// The outcome of checking an index against a config.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Validation {
    pub census: Census,
    /// Language-model tensors the config does not explain; reported, not fatal.
    pub unexpected: Vec<String>,
    /// Tensors outside the `language_model.` prefix (a vision tower, a draft head, a renamed
    /// checkpoint): k3ring reads none of them; reported, not fatal.
    pub outside_prefix: Vec<String>,
}

/// The prefix of every tensor k3ring reads.
pub const LANGUAGE_MODEL_PREFIX: &str = "language_model.";

impl CheckpointIndex {
    /// Checks every tensor the config requires: present, dtype, shape. The first problem is an
    /// error naming the tensor (exit 3). The counts that size the list of expected tensors
    /// (layers, experts) are checked against the headers first.
    pub fn validate(&self, cfg: &Config) -> Result<Validation, CheckpointError> {
        self.check_config_sizes(cfg)?;
        let expected = expected_tensors(cfg);
        let mut census = Census {
            layers: (0..cfg.n_layers).map(|layer| LayerCensus { layer, ..Default::default() }).collect(),
            bytes_per_expert: cfg.expert_bytes(),
            ..Default::default()
        };
        let mut seen = vec![false; self.tensors.len()];
        for e in &expected {
            let pos = self.position(&e.name).ok_or_else(|| CheckpointError::Schema {
                tensor: e.name.clone(),
                message: "missing from the checkpoint".to_owned(),
            })?;
            seen[pos] = true;
            let info = &self.tensors[pos];
            check_one(e, info)?;
            match (e.layer, e.expert) {
                (Some(l), Some(_)) => census.layers[l].expert_bytes += info.len,
                (Some(l), None) => census.layers[l].trunk_bytes += info.len,
                (None, _) => census.global_bytes += info.len,
            }
        }
        census.trunk_bytes = census.layers.iter().map(|l| l.trunk_bytes).sum::<u64>() + census.global_bytes;
        census.expert_bytes = census.layers.iter().map(|l| l.expert_bytes).sum();
        census.n_experts_total = self.experts.len();
        census.non_contiguous_experts = self.experts.non_contiguous().count();
        let unexpected = self
            .tensors
            .iter()
            .zip(&seen)
            .filter(|(t, &s)| !s && t.name.starts_with(LANGUAGE_MODEL_PREFIX))
            .map(|(t, _)| t.name.clone())
            .collect();
        let outside_prefix = self
            .tensors
            .iter()
            .filter(|t| !t.name.starts_with(LANGUAGE_MODEL_PREFIX))
            .map(|t| t.name.clone())
            .collect();
        Ok(Validation { census, unexpected, outside_prefix })
    }
}

fn check_one(e: &ExpectedTensor, info: &super::TensorInfo) -> Result<(), CheckpointError> {
    if info.dtype != e.dtype {
        return Err(CheckpointError::Schema {
            tensor: e.name.clone(),
            message: format!("dtype is {} but the config requires {}", info.dtype.name(), e.dtype.name()),
        });
    }
    if !e.shapes.contains(&info.shape) {
        let want: Vec<String> = e.shapes.iter().map(|s| format!("{s:?}")).collect();
        return Err(CheckpointError::Schema {
            tensor: e.name.clone(),
            message: format!("shape is {:?} but the config requires {}", info.shape, want.join(" or ")),
        });
    }
    Ok(())
}
