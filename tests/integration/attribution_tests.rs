//! The per-operation-class attribution of the resident decode (issue 19): outputs are the same
//! bits with it on and off, each class's weight bytes per decoded token are the sizes of the
//! checkpoint's tensors of that class, and the table's rows sum to the measured s/token.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use k3ring::engine::measure::{measure_resident, MeasureSpec};
use k3ring::engine::measure_batch::{measure_resident_batch, BatchSpec};
use k3ring::engine::GenerateOptions;
use k3ring::model::attribution::{Attribution, OpClass, Window};
use k3ring::model::LogitRows;
use kernels::{Isa, Kernels};

use crate::common::{open, prompt, tiny_dir};

/// Every tensor of the model's shards with its byte size, read from the safetensors headers
/// (not through the engine's index).
fn tensor_sizes(dir: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if !(name.starts_with("model-") && name.ends_with(".safetensors")) {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (tensor, e) in header.as_object().unwrap() {
            if tensor == "__metadata__" {
                continue;
            }
            let off = e["data_offsets"].as_array().unwrap();
            out.insert(tensor.clone(), off[1].as_u64().unwrap() - off[0].as_u64().unwrap());
        }
    }
    out
}

/// The class whose compute reads trunk tensor `name` of a layer of attention kind `mla`.
fn class_of(name: &str, mla: bool) -> OpClass {
    let has = |s: &str| name.contains(s);
    if has("lm_head") {
        OpClass::LmHead
    } else if has("attention_res_") || has("mlp_res_") || has("output_attn_res_") {
        OpClass::ResidualReads
    } else if has("shared_experts.") {
        OpClass::SharedExperts
    } else if has("routed_expert_down_proj") || has("routed_expert_up_proj") {
        OpClass::LatentProjections
    } else if has("block_sparse_moe.gate.") {
        OpClass::Router
    } else if has(".mlp.") {
        OpClass::DenseFfn
    } else if has("_conv1d") {
        OpClass::KdaRecurrence
    } else if has("kv_b_proj") {
        OpClass::MlaAttention
    } else if has("self_attn.") && has("_proj") {
        if mla {
            OpClass::MlaProjections
        } else {
            OpClass::KdaProjections
        }
    } else {
        // RMSNorm weights, A_log, dt_bias, o_norm, the final norm.
        OpClass::NormsActivations
    }
}

/// Weight bytes per decoded token of each class, from the checkpoint's tensor sizes: every
/// trunk tensor the forward pass reads once, one embedding row, and top_k experts per MoE
/// layer.
fn expected_bytes_per_token(dir: &Path) -> BTreeMap<&'static str, u64> {
    let sizes = tensor_sizes(dir);
    let cfg = k3ring::config::Config::from_model_dir(dir).unwrap();
    let layer_of = |name: &str| -> Option<usize> {
        let rest = name.split("layers.").nth(1)?;
        rest.split('.').next()?.parse().ok()
    };
    let mla_layers: Vec<usize> =
        sizes.keys().filter(|n| n.ends_with("self_attn.kv_b_proj.weight")).filter_map(|n| layer_of(n)).collect();
    let mut out: BTreeMap<&'static str, u64> = BTreeMap::new();
    for (name, &size) in &sizes {
        if name.contains(".experts.") {
            // Expert 0 of each MoE layer stands for every expert of the layer (equal sizes).
            if name.contains(".experts.0.") {
                *out.entry(OpClass::ExpertProducts.name()).or_default() += cfg.moe.top_k as u64 * size;
            }
            continue;
        }
        if name.contains("embed_tokens") {
            *out.entry(OpClass::Embedding.name()).or_default() += 2 * cfg.hidden_size as u64;
            continue;
        }
        if layer_of(name) == Some(0) && name.contains("self_attention_res_") {
            // Spec 5, step 1: layer 0 reads its input as is (no snapshot yet), so its attention
            // residual weights are in the checkpoint but never read.
            continue;
        }
        let mla = layer_of(name).is_some_and(|l| mla_layers.contains(&l));
        *out.entry(class_of(name, mla).name()).or_default() += size;
    }
    out
}

#[test]
fn attribution_bytes_per_token_are_the_checkpoint_sizes_of_each_class() {
    let dir = tiny_dir();
    let mut o = open(&dir, 2, Isa::best());
    let attribution = Arc::new(Attribution::new());
    o.engine.model.attribution = Some(Arc::clone(&attribution));
    let p = prompt();
    let steps = 3;
    let mut sess = o.engine.session(p.len() + steps + 1, 8).unwrap();
    let vocab = o.engine.model.cfg.vocab_size;
    let logits = o.engine.prefill(&mut sess, &p, LogitRows::Last, None).unwrap();
    let mut next = common_argmax(&logits[..vocab]);
    attribution.reset();
    for _ in 0..steps {
        let logits = o.engine.prefill(&mut sess, &[next], LogitRows::Last, None).unwrap();
        next = common_argmax(&logits[..vocab]);
    }
    let got: BTreeMap<&'static str, u64> = attribution
        .totals()
        .into_iter()
        .filter(|(_, t)| t.bytes > 0)
        .map(|(c, t)| {
            assert_eq!(t.bytes % steps as u64, 0, "{}: {} bytes over {steps} tokens", c.name(), t.bytes);
            (c.name(), t.bytes / steps as u64)
        })
        .collect();
    let want = expected_bytes_per_token(&dir);
    assert_eq!(got, want, "weight bytes per token by class: counted (left) against the checkpoint (right)");
    // Every class of this model (it has KDA, MLA, dense and MoE layers) did some work.
    for (c, t) in attribution.totals() {
        assert!(t.calls > 0, "{} was never timed", c.name());
    }
}

fn common_argmax(row: &[f32]) -> u32 {
    crate::common::argmax(row)
}

fn greedy(o: &k3ring::engine::Opened, chunk: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let opts = GenerateOptions { gen: 12, prefill_chunk: chunk, keep_logits: true, ..Default::default() };
    let g = o.engine.generate(&prompt(), &opts, |_| {}).unwrap();
    (g.generated_ids, g.logits.iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect())
}

#[test]
fn attribution_on_and_off_give_the_same_ids_and_logit_bits() {
    let dir = tiny_dir();
    for isa in Isa::available() {
        for chunk in [1, 32] {
            let off = greedy(&open(&dir, 2, isa), chunk);
            let mut on_model = open(&dir, 2, isa);
            let attribution = Arc::new(Attribution::new());
            on_model.engine.model.attribution = Some(Arc::clone(&attribution));
            let on = greedy(&on_model, chunk);
            assert_eq!(on.0, off.0, "{isa:?}, chunk {chunk}: ids changed with attribution on");
            assert!(on.1 == off.1, "{isa:?}, chunk {chunk}: logit bits changed with attribution on");
            let calls: u64 = attribution.totals().iter().map(|(_, t)| t.calls).sum();
            assert!(calls > 0, "attribution on counted nothing");
        }
    }
}

#[test]
fn attribution_rows_sum_to_the_measured_seconds_per_token() {
    let dir = tiny_dir();
    let spec = MeasureSpec { prompt: prompt(), warmup: 2, tokens: 6, prefill_chunk: 32 };
    let m = measure_resident(&dir, Kernels::with_isa(Isa::best()).unwrap(), 2, &spec).unwrap();
    let window = m.attribution.as_ref().expect("a resident measurement carries its attribution");
    assert_eq!(window.tokens, spec.tokens);
    let table = window.table(Some(10e9), None);
    let sum: f64 = table.rows.iter().map(|r| r.seconds_per_token).sum();
    assert!(
        (sum - m.seconds_per_token).abs() <= 1e-9 * m.seconds_per_token,
        "rows sum to {sum} s/token, measured {}",
        m.seconds_per_token
    );
    assert_eq!(table.seconds_per_token, m.seconds_per_token);
    // Timed regions never nest: the classes alone cannot exceed the wall time.
    assert!(table.other_seconds_per_token >= 0.0, "classes sum beyond the measured time: {table:?}");
    let classes = &table.rows[..table.rows.len() - 1];
    assert!(classes.iter().all(|r| r.seconds_per_token > 0.0), "a class measured no time: {table:?}");
    // The idle row is the sum of the parallel products' idle time, class by class.
    let idle_row = table.rows.iter().find(|r| r.class == "parallel_idle").unwrap();
    let idle_parts: f64 = table.rows.iter().map(|r| r.idle_seconds_per_token).sum();
    assert!((idle_row.seconds_per_token - idle_parts).abs() <= 1e-12, "{idle_parts} against {idle_row:?}");
    let shares: f64 = table.rows.iter().map(|r| r.share).sum();
    assert!((shares - 1.0).abs() < 1e-9, "shares sum to {shares}");
    let want: u64 = expected_bytes_per_token(&dir).values().sum();
    assert_eq!(table.bytes_per_token, want as f64);
    let floor = table.floor_seconds_per_token.unwrap();
    assert!((floor - want as f64 / 10e9).abs() < 1e-15);
}

#[test]
fn a_traced_run_reports_the_attribution_of_its_decode() {
    let (_, report) = crate::trace_check::streamed_trace(&["--mem-gb", "0.0014"]);
    let table = &report["attribution"];
    let rows = table["rows"].as_array().expect("run --trace reports the attribution");
    let seconds_per_token = report["seconds_per_token"].as_f64().unwrap();
    assert_eq!(table["seconds_per_token"].as_f64(), Some(seconds_per_token));
    let sum: f64 = rows.iter().map(|r| r["seconds_per_token"].as_f64().unwrap()).sum();
    assert!(
        (sum - seconds_per_token).abs() <= 1e-9 * seconds_per_token,
        "rows sum to {sum}, s/token {seconds_per_token}"
    );
    assert!(table["other_seconds_per_token"].as_f64().unwrap() >= 0.0);
    // Streamed or resident, the decode touches the same weight bytes per token.
    let want: u64 = expected_bytes_per_token(&tiny_dir()).values().sum();
    assert_eq!(table["bytes_per_token"].as_f64(), Some(want as f64));
    // Without --trace there is no table, and the same ids.
    let (_, untraced) = crate::trace_check::streamed_run(&["--mem-gb", "0.0014"]);
    assert!(untraced.get("attribution").is_none());
    assert_eq!(untraced["generated_ids"], report["generated_ids"]);
}

/// Each class's multiply-adds per token (or per step) of a measured window.
fn macs_per(window: &Window) -> BTreeMap<&'static str, u64> {
    let n = window.tokens as u64;
    window.totals.iter().map(|(c, t)| (c.name(), t.macs / n)).filter(|(_, m)| *m > 0).collect()
}

#[test]
fn a_batch_step_counts_the_multiply_adds_of_every_row() {
    let dir = tiny_dir();
    let kernels = Kernels::with_isa(Isa::best()).unwrap();
    let spec = MeasureSpec { prompt: prompt(), warmup: 1, tokens: 3, prefill_chunk: 32 };
    let solo = measure_resident(&dir, kernels, 2, &spec).unwrap();
    let one = macs_per(solo.attribution.as_ref().unwrap());
    // A token's products: each bf16 weight once, and each routed expert's (top-k per layer)
    // MXFP4 weights once, 32 weights in 17 bytes (16 packed bytes and a scale).
    let bytes = expected_bytes_per_token(&dir);
    for (class, macs) in &one {
        let weights = if *class == OpClass::ExpertProducts.name() { bytes[class] * 32 / 17 } else { bytes[class] / 2 };
        assert_eq!(*macs, weights, "{class}: multiply-adds per token against its weights");
    }
    assert!(one.contains_key(OpClass::ExpertProducts.name()) && one.contains_key(OpClass::LmHead.name()), "{one:?}");
    let prompts: Vec<Vec<u32>> = (0..3u32).map(|i| [prompt(), vec![100 + i]].concat()).collect();
    let batch = BatchSpec { prompts, warmup: 1, steps: 2, prefill_chunk: 32 };
    let m = measure_resident_batch(&dir, kernels, 2, &batch).unwrap();
    let window = m.attribution.as_ref().expect("a resident batch carries its attribution");
    assert_eq!((window.per, window.tokens), ("step", 2));
    // A step of three rows does three tokens' multiply-adds in every class, however the rows
    // share the experts.
    let three: BTreeMap<&str, u64> = one.iter().map(|(c, m)| (*c, 3 * m)).collect();
    assert_eq!(macs_per(window), three);
    let table = window.table(Some(10e9), Some(100e9));
    assert_eq!(table.per, "step");
    // The experts' roof: three rows' flops at 100 GFLOP/s against their bytes at 10 GB/s.
    let experts = table.rows.iter().find(|r| r.class == "expert_products").unwrap();
    let want = (experts.bytes_per_token / 10e9).max(experts.flops_per_token / 100e9);
    assert_eq!(experts.roof_seconds_per_token, Some(want));
    assert_eq!(experts.flops_per_token, 2.0 * three[OpClass::ExpertProducts.name()] as f64);
}
