//! `k3ring inspect`: config summary, layer map, block starts, byte census, tensor validation.

use anyhow::Context;
use serde::Serialize;

use super::InspectArgs;
use crate::checkpoint::{CheckpointIndex, Validation};
use crate::config::Config;

#[derive(Serialize)]
struct Report<'a> {
    model: String,
    config: &'a Config,
    layer_map: String,
    block_starts: Vec<usize>,
    shards: usize,
    tensors: usize,
    validation: &'a Validation,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let json = super::output::JsonOut::open(args.json.as_deref())?;
    let cfg = Config::from_model_dir(&args.model)?;
    let index = CheckpointIndex::open(&args.model).with_context(|| format!("indexing {}", args.model.display()))?;
    let validation = index.validate(&cfg)?;
    let report = Report {
        model: args.model.display().to_string(),
        config: &cfg,
        layer_map: cfg.layer_map(),
        block_starts: cfg.block_starts(),
        shards: index.shards.len(),
        tensors: index.tensors.len(),
        validation: &validation,
    };
    if !super::output::JsonOut::is_stdout(json.as_ref()) {
        print_text(&report, &cfg);
    }
    if let Some(out) = &json {
        out.write(&report)?;
    }
    Ok(())
}

/// Decimal units, like `--mem-gb` (10^9 bytes) and every other size k3ring prints.
fn gb(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

fn print_text(r: &Report<'_>, cfg: &Config) {
    let c = &r.validation.census;
    println!("model       {}", r.model);
    println!(
        "dims        hidden {}  vocab {}  layers {}  dense FFN {}",
        cfg.hidden_size, cfg.vocab_size, cfg.n_layers, cfg.dense_intermediate
    );
    println!(
        "KDA         {} heads x {}  conv {}  gate lower bound {}",
        cfg.kda.n_heads, cfg.kda.head_dim, cfg.kda.conv_kernel_size, cfg.kda.gate_lower_bound
    );
    println!(
        "MLA         {} heads  q_lora {}  kv_lora {}  nope/shared/v {}/{}/{}  cache {} floats/position",
        cfg.mla.n_heads,
        cfg.mla.q_lora_rank,
        cfg.mla.kv_lora_rank,
        cfg.mla.qk_nope_head_dim,
        cfg.mla.qk_rope_head_dim,
        cfg.mla.v_head_dim,
        cfg.mla.cache_width()
    );
    println!(
        "MoE         {} experts, top-{}, {} shared, F {}, latent {}, MXFP4 groups of {}",
        cfg.moe.n_experts,
        cfg.moe.top_k,
        cfg.moe.n_shared_experts,
        cfg.moe.expert_hidden,
        cfg.moe.latent,
        cfg.mxfp4_group_size
    );
    println!("layer map   {}", r.layer_map);
    println!("block starts {:?}", r.block_starts);
    println!("shards      {}  tensors {}", r.shards, r.tensors);
    println!(
        "bytes       trunk {} (layers {} + embedding/head/norms {})  experts {} ({} x {})",
        gb(c.trunk_bytes),
        gb(c.trunk_bytes - c.global_bytes),
        gb(c.global_bytes),
        gb(c.expert_bytes),
        c.n_experts_total,
        gb(c.bytes_per_expert)
    );
    println!("            experts needing more than one read: {}", c.non_contiguous_experts);
    println!("layer   kind  trunk        experts");
    for (l, lc) in c.layers.iter().enumerate() {
        let plan = cfg.layers[l];
        println!(
            "{:>5}   {}{}{}   {:>10}   {:>10}",
            l,
            if plan.attn == crate::config::AttnKind::Kda { 'K' } else { 'M' },
            if plan.ffn == crate::config::FfnKind::Dense { 'D' } else { 'E' },
            if plan.block_start { '*' } else { ' ' },
            gb(lc.trunk_bytes),
            gb(lc.expert_bytes)
        );
    }
    for name in &r.validation.unexpected {
        println!("warning: tensor {name} is not used by this config");
    }
    let outside = &r.validation.outside_prefix;
    if !outside.is_empty() {
        // A whole vision tower would be thousands of lines: the count and a few names.
        const SHOWN: usize = 5;
        let names = outside.iter().take(SHOWN).map(String::as_str).collect::<Vec<_>>().join(", ");
        let more = if outside.len() > SHOWN { format!(" and {} more", outside.len() - SHOWN) } else { String::new() };
        println!(
            "warning: {} tensors lie outside the expected prefix {} and are not used: {names}{more}",
            outside.len(),
            crate::checkpoint::LANGUAGE_MODEL_PREFIX
        );
    }
    println!("ok: every tensor the config requires is present with the right dtype and shape");
}
