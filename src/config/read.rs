//! The first stage of reading `config.json`: a collector that records every missing or
//! ill-typed key into [`RawConfig`], then the structural checks [`super::Config`] runs on it.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::*;

/// Every field the math needs, read from either config shape before structural validation.
#[derive(Clone, Debug, PartialEq)]
pub struct RawConfig {
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: Option<u32>,
    pub tie_word_embeddings: bool,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub hidden_act: String,
    pub activation_situ_beta: f32,
    pub activation_situ_linear_beta: Option<f32>,
    pub rms_norm_eps: f32,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub mla_use_nope: bool,
    pub mla_use_output_gate: bool,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    pub latent_moe_use_norm: bool,
    pub moe_renormalize: bool,
    pub moe_router_activation_func: String,
    pub routed_scaling_factor: f32,
    pub num_expert_group: usize,
    pub topk_group: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub attn_res_block_size: usize,
    pub kda_num_heads: usize,
    pub kda_head_dim: usize,
    pub short_conv_kernel_size: usize,
    pub gate_lower_bound: f32,
    pub use_full_rank_gate: bool,
    /// 1-based, as in the file.
    pub full_attn_layers: Vec<i64>,
    /// 1-based, as in the file.
    pub kda_layers: Vec<i64>,
    pub quant_format: String,
    pub group_size: usize,
    /// The first of [`CONTEXT_KEYS`] present; optional.
    pub context_length: Option<ContextLength>,
}

/// Looks keys up in a JSON object and records every problem instead of stopping at the first.
struct Collector<'a> {
    problems: Vec<String>,
    scope: &'a str,
    obj: Option<&'a Map<String, Value>>,
}

impl<'a> Collector<'a> {
    fn value(&mut self, key: &str) -> Option<&'a Value> {
        match self.obj.and_then(|o| o.get(key)) {
            Some(v) => Some(v),
            None => {
                self.problems.push(format!("{}{key} is missing", self.scope));
                None
            }
        }
    }

    fn ill_typed(&mut self, key: &str, want: &str, got: &Value) {
        self.problems.push(format!("{}{key} must be {want}, found {got}", self.scope));
    }

    fn usize(&mut self, key: &str) -> usize {
        let Some(v) = self.value(key) else { return 0 };
        match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) => n,
            None => {
                self.ill_typed(key, "a non-negative integer", v);
                0
            }
        }
    }

    fn u32(&mut self, key: &str) -> u32 {
        let Some(v) = self.value(key) else { return 0 };
        match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => n,
            None => {
                self.ill_typed(key, "a token id (u32)", v);
                0
            }
        }
    }

    fn f32(&mut self, key: &str) -> f32 {
        let Some(v) = self.value(key) else { return 0.0 };
        // Finite as the f32 the model computes with: 1e100 is a finite f64 but an infinite f32.
        match v.as_f64().map(|x| x as f32) {
            Some(x) if x.is_finite() => x,
            _ => {
                self.ill_typed(key, "a finite number (within f32 range)", v);
                0.0
            }
        }
    }

    /// A number or `null` (null is meaningful: an uncapped SiTU branch).
    fn opt_f32(&mut self, key: &str) -> Option<f32> {
        let v = self.value(key)?;
        if v.is_null() {
            return None;
        }
        match v.as_f64().map(|x| x as f32) {
            Some(x) if x.is_finite() => Some(x),
            _ => {
                self.ill_typed(key, "a finite number (within f32 range) or null", v);
                None
            }
        }
    }

    /// An optional key: absent or null gives `None`.
    fn opt_u32(&mut self, key: &str) -> Option<u32> {
        let v = self.obj.and_then(|o| o.get(key))?;
        if v.is_null() {
            return None;
        }
        let n = v.as_u64().and_then(|n| u32::try_from(n).ok());
        if n.is_none() {
            self.ill_typed(key, "a token id (u32) or null", v);
        }
        n
    }

    fn bool(&mut self, key: &str) -> bool {
        let Some(v) = self.value(key) else { return false };
        match v.as_bool() {
            Some(b) => b,
            None => {
                self.ill_typed(key, "true or false", v);
                false
            }
        }
    }

    fn string(&mut self, key: &str) -> String {
        let Some(v) = self.value(key) else { return String::new() };
        match v.as_str() {
            Some(s) => s.to_owned(),
            None => {
                self.ill_typed(key, "a string", v);
                String::new()
            }
        }
    }

    fn int_list(&mut self, key: &str) -> Vec<i64> {
        let Some(v) = self.value(key) else { return Vec::new() };
        let list = v.as_array().and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>());
        match list {
            Some(l) => l,
            None => {
                self.ill_typed(key, "a list of integers", v);
                Vec::new()
            }
        }
    }

    fn object(&mut self, key: &str) -> Option<&'a Map<String, Value>> {
        let v = self.value(key)?;
        let obj = v.as_object();
        if obj.is_none() {
            self.ill_typed(key, "an object", v);
        }
        obj
    }
}

/// Where each group of keys lives: nested (the release) or flat (all keys at the root).
struct Scopes<'a> {
    root: Option<&'a Map<String, Value>>,
    text: Option<&'a Map<String, Value>>,
    text_scope: &'static str,
    linear: Option<&'a Map<String, Value>>,
    linear_scope: &'static str,
    quant: Option<&'a Map<String, Value>>,
    quant_scope: &'static str,
}

impl RawConfig {
    /// Reads every required key; on failure returns the full list of problems.
    pub fn from_value(value: &Value) -> Result<RawConfig, Vec<String>> {
        let Some(root) = value.as_object() else {
            return Err(vec!["the top level must be a JSON object".to_owned()]);
        };
        let mut problems = Vec::new();
        let scopes = find_scopes(root, &mut problems);
        let raw = read_all(&scopes, &mut problems);
        if problems.is_empty() {
            Ok(raw)
        } else {
            Err(problems)
        }
    }
}

fn find_scopes<'a>(root: &'a Map<String, Value>, problems: &mut Vec<String>) -> Scopes<'a> {
    let mut top = Collector { problems: Vec::new(), scope: "", obj: Some(root) };
    let nested = root.contains_key("text_config");
    let (text, text_scope) = if nested { (top.object("text_config"), "text_config.") } else { (Some(root), "") };
    let mut text_c = Collector { problems: Vec::new(), scope: text_scope, obj: text };
    // The flat shape also allows linear_attn_config keys at the root.
    let (linear, linear_scope) = match text.and_then(|t| t.get("linear_attn_config")) {
        Some(_) if nested => (text_c.object("linear_attn_config"), "text_config.linear_attn_config."),
        Some(_) => (text_c.object("linear_attn_config"), "linear_attn_config."),
        None if nested => (text_c.object("linear_attn_config"), "text_config.linear_attn_config."),
        None => (text, ""),
    };
    let quant_in_text = text.is_some_and(|t| t.contains_key("quantization_config"));
    let (quant, quant_scope) = if quant_in_text {
        (
            text_c.object("quantization_config"),
            if nested { "text_config.quantization_config." } else { "quantization_config." },
        )
    } else if root.contains_key("quantization_config") {
        (top.object("quantization_config"), "quantization_config.")
    } else {
        // Report it under the scope the release uses.
        (
            text_c.object("quantization_config"),
            if nested { "text_config.quantization_config." } else { "quantization_config." },
        )
    };
    problems.append(&mut top.problems);
    problems.append(&mut text_c.problems);
    Scopes { root: Some(root), text, text_scope, linear, linear_scope, quant, quant_scope }
}

fn read_all(s: &Scopes<'_>, problems: &mut Vec<String>) -> RawConfig {
    let mut top = Collector { problems: Vec::new(), scope: "", obj: s.root };
    let mut t = Collector { problems: Vec::new(), scope: s.text_scope, obj: s.text };
    let mut la = Collector { problems: Vec::new(), scope: s.linear_scope, obj: s.linear };
    let mut q = Collector { problems: Vec::new(), scope: s.quant_scope, obj: s.quant };
    let (quant_format, group_size) = read_quant(&mut q);
    let raw = RawConfig {
        bos_token_id: top.u32("bos_token_id"),
        eos_token_id: top.u32("eos_token_id"),
        pad_token_id: top.opt_u32("pad_token_id"),
        tie_word_embeddings: top.bool("tie_word_embeddings"),
        vocab_size: t.usize("vocab_size"),
        hidden_size: t.usize("hidden_size"),
        num_hidden_layers: t.usize("num_hidden_layers"),
        intermediate_size: t.usize("intermediate_size"),
        hidden_act: t.string("hidden_act"),
        activation_situ_beta: t.f32("activation_situ_beta"),
        activation_situ_linear_beta: t.opt_f32("activation_situ_linear_beta"),
        rms_norm_eps: t.f32("rms_norm_eps"),
        num_attention_heads: t.usize("num_attention_heads"),
        q_lora_rank: t.usize("q_lora_rank"),
        kv_lora_rank: t.usize("kv_lora_rank"),
        qk_nope_head_dim: t.usize("qk_nope_head_dim"),
        qk_rope_head_dim: t.usize("qk_rope_head_dim"),
        v_head_dim: t.usize("v_head_dim"),
        mla_use_nope: t.bool("mla_use_nope"),
        mla_use_output_gate: t.bool("mla_use_output_gate"),
        num_experts: t.usize("num_experts"),
        num_experts_per_token: t.usize("num_experts_per_token"),
        num_shared_experts: t.usize("num_shared_experts"),
        moe_intermediate_size: t.usize("moe_intermediate_size"),
        routed_expert_hidden_size: t.usize("routed_expert_hidden_size"),
        latent_moe_use_norm: t.bool("latent_moe_use_norm"),
        moe_renormalize: t.bool("moe_renormalize"),
        moe_router_activation_func: t.string("moe_router_activation_func"),
        routed_scaling_factor: t.f32("routed_scaling_factor"),
        num_expert_group: t.usize("num_expert_group"),
        topk_group: t.usize("topk_group"),
        first_k_dense_replace: t.usize("first_k_dense_replace"),
        moe_layer_freq: t.usize("moe_layer_freq"),
        attn_res_block_size: t.usize("attn_res_block_size"),
        kda_num_heads: la.usize("num_heads"),
        kda_head_dim: la.usize("head_dim"),
        short_conv_kernel_size: la.usize("short_conv_kernel_size"),
        gate_lower_bound: la.f32("gate_lower_bound"),
        use_full_rank_gate: la.bool("use_full_rank_gate"),
        full_attn_layers: la.int_list("full_attn_layers"),
        kda_layers: la.int_list("kda_layers"),
        quant_format,
        group_size,
        context_length: read_context_length(&mut [&mut t, &mut top]),
    };
    for c in [top, t, la, q] {
        problems.extend(c.problems);
    }
    raw
}

/// The first context key present in the scopes, in order; an ill-typed one is a problem.
fn read_context_length(scopes: &mut [&mut Collector<'_>]) -> Option<ContextLength> {
    for c in scopes.iter_mut() {
        for key in CONTEXT_KEYS {
            let Some(v) = c.obj.and_then(|o| o.get(key)) else { continue };
            match v.as_u64().and_then(|n| usize::try_from(n).ok()).filter(|&n| n > 0) {
                Some(positions) => {
                    return Some(ContextLength { positions, source: format!("{}{key} in config.json", c.scope) })
                }
                None => {
                    c.ill_typed(key, "a positive integer", v);
                    return None;
                }
            }
        }
    }
    None
}

/// `model_max_length` of a tokenizer_config.json when it is a plausible context length; any
/// problem with the file is left to the tokenizer's loader.
pub(super) fn tokenizer_context_length(path: &Path) -> Option<ContextLength> {
    // Bounded and never blocking (a FIFO is left to the tokenizer's loader to refuse).
    let bytes =
        crate::files::input::read_regular(path, crate::tokenizer::TOKENIZER_FILE_MAX, "a tokenizer file").ok()?;
    let text = String::from_utf8(bytes).ok()?;
    let value: Value = serde_json::from_str(&text).ok()?;
    let n = value.get("model_max_length")?.as_u64().filter(|&n| n > 0 && n <= TOKENIZER_CONTEXT_MAX)?;
    Some(ContextLength {
        positions: usize::try_from(n).ok()?,
        source: "model_max_length in tokenizer_config.json".into(),
    })
}

/// `format` and the MXFP4 group size. In the release the size sits in
/// `config_groups.<name>.weights.group_size`; a bare `group_size` is accepted for test configs.
fn read_quant(q: &mut Collector<'_>) -> (String, usize) {
    let format = q.string("format");
    let Some(obj) = q.obj else { return (format, 0) };
    if obj.contains_key("group_size") {
        return (format, q.usize("group_size"));
    }
    let Some(groups) = q.object("config_groups") else { return (format, 0) };
    let mut sizes = Vec::new();
    for (name, group) in groups {
        let size = group.pointer("/weights/group_size").and_then(Value::as_u64);
        match size.and_then(|n| usize::try_from(n).ok()) {
            Some(n) => sizes.push(n),
            None => q
                .problems
                .push(format!("{}config_groups.{name}.weights.group_size is missing or not an integer", q.scope)),
        }
    }
    match sizes.first() {
        None if q.problems.is_empty() => {
            q.problems.push(format!("{}config_groups has no group with weights.group_size", q.scope));
            (format, 0)
        }
        None => (format, 0),
        Some(&first) if sizes.iter().all(|&s| s == first) => (format, first),
        Some(_) => {
            q.problems.push(format!("{}config_groups disagree on group_size: {sizes:?}", q.scope));
            (format, 0)
        }
    }
}

/// Refuses the variants the engine does not implement, naming the key.
pub(super) fn check_supported(raw: &RawConfig) -> Result<(), String> {
    let checks: [(bool, String); 10] = [
        (raw.hidden_act == "situ", format!("hidden_act is {:?}; only \"situ\" is implemented", raw.hidden_act)),
        (
            raw.moe_router_activation_func == "sigmoid",
            format!("moe_router_activation_func is {:?}; only \"sigmoid\"", raw.moe_router_activation_func),
        ),
        (raw.mla_use_nope, "mla_use_nope is false; only NoPE MLA is implemented".to_owned()),
        (raw.mla_use_output_gate, "mla_use_output_gate is false; only gated MLA is implemented".to_owned()),
        (raw.latent_moe_use_norm, "latent_moe_use_norm is false; only the normed latent MoE".to_owned()),
        (raw.moe_renormalize, "moe_renormalize is false; only renormalised routing".to_owned()),
        (raw.use_full_rank_gate, "use_full_rank_gate is false; only the full-rank KDA gate".to_owned()),
        (!raw.tie_word_embeddings, "tie_word_embeddings is true; K3's lm_head is untied".to_owned()),
        (
            raw.num_expert_group == 1 && raw.topk_group == 1,
            format!(
                "num_expert_group {} / topk_group {}; only ungrouped routing (1 / 1)",
                raw.num_expert_group, raw.topk_group
            ),
        ),
        (
            raw.quant_format == "mxfp4-pack-quantized",
            format!("quantization_config.format is {:?}; only \"mxfp4-pack-quantized\"", raw.quant_format),
        ),
    ];
    match checks.into_iter().find(|(ok, _)| !ok) {
        Some((_, message)) => Err(message),
        None => Ok(()),
    }
}

pub(super) fn check_dims(raw: &RawConfig) -> Result<(), String> {
    let positive = [
        ("vocab_size", raw.vocab_size),
        ("hidden_size", raw.hidden_size),
        ("num_hidden_layers", raw.num_hidden_layers),
        ("num_attention_heads", raw.num_attention_heads),
        ("q_lora_rank", raw.q_lora_rank),
        ("kv_lora_rank", raw.kv_lora_rank),
        ("qk_nope_head_dim", raw.qk_nope_head_dim),
        ("v_head_dim", raw.v_head_dim),
        ("num_experts", raw.num_experts),
        ("num_experts_per_token", raw.num_experts_per_token),
        ("moe_intermediate_size", raw.moe_intermediate_size),
        ("routed_expert_hidden_size", raw.routed_expert_hidden_size),
        ("attn_res_block_size", raw.attn_res_block_size),
        ("moe_layer_freq", raw.moe_layer_freq),
        ("linear_attn_config.num_heads", raw.kda_num_heads),
        ("linear_attn_config.head_dim", raw.kda_head_dim),
        ("linear_attn_config.short_conv_kernel_size", raw.short_conv_kernel_size),
        ("quantization group_size", raw.group_size),
    ];
    if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(format!("{key} must be positive"));
    }
    check_bounds(raw)?;
    if raw.num_experts_per_token > raw.num_experts {
        return Err(format!(
            "num_experts_per_token {} exceeds num_experts {}",
            raw.num_experts_per_token, raw.num_experts
        ));
    }
    if raw.group_size != 32 {
        return Err(format!("MXFP4 group_size is {}; the format fixes it at 32", raw.group_size));
    }
    for (name, width) in [
        ("routed_expert_hidden_size", raw.routed_expert_hidden_size),
        ("moe_intermediate_size", raw.moe_intermediate_size),
    ] {
        if width % raw.group_size != 0 {
            return Err(format!(
                "MXFP4 group_size {} does not divide the contraction width {name} = {width}",
                raw.group_size
            ));
        }
    }
    if raw.first_k_dense_replace > 0 && raw.intermediate_size == 0 {
        return Err("intermediate_size must be positive when first_k_dense_replace > 0".to_owned());
    }
    if raw.gate_lower_bound >= 0.0 {
        return Err(format!("linear_attn_config.gate_lower_bound {} must be negative", raw.gate_lower_bound));
    }
    if raw.rms_norm_eps <= 0.0 || raw.activation_situ_beta <= 0.0 {
        return Err("rms_norm_eps and activation_situ_beta must be positive".to_owned());
    }
    if raw.routed_scaling_factor <= 0.0 {
        return Err(format!("routed_scaling_factor {} must be positive", raw.routed_scaling_factor));
    }
    if raw.activation_situ_linear_beta.is_some_and(|b| b <= 0.0) {
        return Err("activation_situ_linear_beta must be positive or null".to_owned());
    }
    let vocab = raw.vocab_size as u64;
    for (name, id) in [("bos_token_id", raw.bos_token_id), ("eos_token_id", raw.eos_token_id)] {
        if u64::from(id) >= vocab {
            return Err(format!("{name} {id} is outside the vocabulary of {vocab}"));
        }
    }
    Ok(())
}

/// The largest layer count accepted (the cap on layer ids read from checkpoint headers too).
pub const LAYERS_MAX: usize = 4096;

/// Refuses a size above its bound, naming the key and the value. The bounds sit far above K3's
/// sizes (in the comments) and any model a CPU could run, and low enough that no product of sizes
/// overflows and that nothing proportional to a size is built (the layer plan, the list of
/// expected tensors) before the checkpoint confirms it.
fn check_bounds(raw: &RawConfig) -> Result<(), String> {
    let bounded = [
        ("vocab_size", raw.vocab_size, 1 << 24), // 163840; the tokenizer caps ranks at 2^24
        ("hidden_size", raw.hidden_size, 1 << 17), // 7168
        ("num_hidden_layers", raw.num_hidden_layers, LAYERS_MAX), // 93
        ("intermediate_size", raw.intermediate_size, 1 << 20), // 33792
        ("num_attention_heads", raw.num_attention_heads, 4096), // 96
        ("q_lora_rank", raw.q_lora_rank, 1 << 17), // 1536
        ("kv_lora_rank", raw.kv_lora_rank, 1 << 17), // 512
        ("qk_nope_head_dim", raw.qk_nope_head_dim, 4096), // 128
        ("qk_rope_head_dim", raw.qk_rope_head_dim, 4096), // 64
        ("v_head_dim", raw.v_head_dim, 4096),    // 128
        ("num_experts", raw.num_experts, 1 << 16), // 896
        ("num_experts_per_token", raw.num_experts_per_token, 1024), // 16
        ("num_shared_experts", raw.num_shared_experts, 64), // 2
        ("moe_intermediate_size", raw.moe_intermediate_size, 1 << 17), // 3072
        ("routed_expert_hidden_size", raw.routed_expert_hidden_size, 1 << 17), // 3584
        ("first_k_dense_replace", raw.first_k_dense_replace, LAYERS_MAX), // 1
        ("moe_layer_freq", raw.moe_layer_freq, LAYERS_MAX), // 1
        ("attn_res_block_size", raw.attn_res_block_size, LAYERS_MAX), // 12
        ("linear_attn_config.num_heads", raw.kda_num_heads, 4096), // 96
        ("linear_attn_config.head_dim", raw.kda_head_dim, 4096), // 128
        ("linear_attn_config.short_conv_kernel_size", raw.short_conv_kernel_size, 64), // 4
    ];
    match bounded.iter().find(|(_, value, max)| value > max) {
        Some((key, value, max)) => Err(format!("{key} is {value}, above the largest this engine accepts ({max})")),
        None => Ok(()),
    }
}

/// Turns the 1-based layer lists into the per-layer plan, refusing any list that is not a
/// partition of 1..=num_hidden_layers.
///
/// Nothing is sized by `num_hidden_layers` until the lists, which are as long as the file
/// allows, are known to cover every layer: a config claiming 10^12 layers is refused at once.
pub(super) fn layer_plan(raw: &RawConfig) -> Result<Vec<LayerPlan>, String> {
    let n = raw.num_hidden_layers;
    let mut kind: BTreeMap<usize, AttnKind> = BTreeMap::new();
    for (list, which, name) in
        [(&raw.full_attn_layers, AttnKind::Mla, "full_attn_layers"), (&raw.kda_layers, AttnKind::Kda, "kda_layers")]
    {
        for &one_based in list {
            let layer = usize::try_from(one_based).ok().filter(|l| (1..=n).contains(l));
            let Some(layer) = layer else {
                let hint = if one_based == 0 { " (the lists are 1-based)" } else { "" };
                return Err(format!("linear_attn_config.{name} holds {one_based}, outside 1..={n}{hint}"));
            };
            if kind.insert(layer, which).is_some() {
                return Err(format!("layer {one_based} (1-based) appears twice in full_attn_layers/kda_layers"));
            }
        }
    }
    // The keys are distinct and inside 1..=n: the first one out of step marks a missing layer.
    let missing = kind.keys().zip(1..).find(|&(&have, want)| have != want).map(|(_, want)| want);
    if let Some(layer) = missing.or((kind.len() < n).then_some(kind.len() + 1)) {
        return Err(format!("layer {layer} (1-based) is in neither full_attn_layers nor kda_layers"));
    }
    let plan = kind
        .into_values()
        .enumerate()
        .map(|(i, attn)| {
            let moe = i >= raw.first_k_dense_replace && i % raw.moe_layer_freq == 0;
            let ffn = if moe { FfnKind::Moe } else { FfnKind::Dense };
            LayerPlan { attn, ffn, block_start: i % raw.attn_res_block_size == 0 }
        })
        .collect();
    Ok(plan)
}
