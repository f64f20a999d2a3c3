//! The forward pass against the float64 oracle on the committed tiny model (issue 3 gates).

use k3ring::engine::GenerateOptions;
use k3ring::model::LogitRows;
use kernels::Isa;

use crate::common::*;

#[test]
fn teacher_forced_argmax_and_last_logits_match_the_reference() {
    let dir = tiny_dir();
    let r = reference_json(&dir);
    let refs = reference_tensors(&dir);
    let prompt = ids(&r["prompt_ids"]);
    let want = ids(&r["teacher_forced_argmax"]);
    for isa in Isa::available() {
        let o = open(&dir, 2, isa);
        let mut sess = o.engine.session(prompt.len(), prompt.len()).unwrap();
        let logits = o.engine.prefill(&mut sess, &prompt, LogitRows::All, None).unwrap().to_vec();
        let v = o.engine.model.cfg.vocab_size;
        let got: Vec<u32> = logits.chunks_exact(v).map(argmax).collect();
        assert_eq!(got, want, "teacher-forced argmax on {isa:?}");
        let last = &logits[(prompt.len() - 1) * v..];
        let diff = rel_max_diff(last, &refs["logits_last"].data);
        assert!(diff <= 1e-4, "last-position logits differ by {diff:e} (relative) on {isa:?}");
    }
}

#[test]
fn greedy_generation_matches_the_reference() {
    let dir = tiny_dir();
    let r = reference_json(&dir);
    let prompt = ids(&r["prompt_ids"]);
    let want = ids(&r["greedy_ids"]);
    let o = open(&dir, 2, Isa::best());
    let opts = GenerateOptions { gen: want.len(), ..Default::default() };
    let g = o.engine.generate(&prompt, &opts, |_| {}).unwrap();
    assert_eq!(g.generated_ids, want);
}

use std::collections::HashMap;
use std::path::Path;

use k3ring::model::moe::Route;
use k3ring::model::Probe;

/// Collects every intermediate of one forward pass.
#[derive(Default)]
struct Recorder {
    tensors: HashMap<String, Vec<f32>>,
    routes: HashMap<usize, Vec<Route>>,
}

impl Probe for Recorder {
    fn tensor(&mut self, layer: Option<usize>, what: &'static str, _t: usize, data: &[f32]) {
        let name = match (what, layer) {
            ("snapshot", Some(j)) => format!("snapshot.{j}"),
            (_, Some(l)) => format!("layers.{l}.{what}"),
            (_, None) => what.to_owned(),
        };
        self.tensors.entry(name).or_default().extend_from_slice(data);
    }
    fn routes(&mut self, layer: usize, routes: &[Route]) {
        self.routes.entry(layer).or_default().extend_from_slice(routes);
    }
}

/// Relative tolerance for intermediates against the float64 oracle: the oracle's own float32
/// re-run differs from float64 by up to ~1e-3 relative in the deep layers of this random model
/// (tests/oracle/README.md), so a correct f32 engine cannot be held tighter.
const INTERMEDIATE_REL_TOL: f64 = 3e-3;

fn run_greedy(
    o: &k3ring::engine::Opened,
    prompt: &[u32],
    n: usize,
    full: bool,
    chunk: usize,
) -> k3ring::engine::Generation {
    let opts =
        GenerateOptions { gen: n, full_recompute: full, prefill_chunk: chunk, keep_logits: true, ..Default::default() };
    o.engine.generate(prompt, &opts, |_| {}).unwrap()
}

fn bits(logits: &[Vec<f32>]) -> Vec<Vec<u32>> {
    logits.iter().map(|row| row.iter().map(|v| v.to_bits()).collect()).collect()
}

#[test]
fn incremental_decode_equals_full_recompute_bit_for_bit() {
    let dir = tiny_dir();
    let r = reference_json(&dir);
    let prompt = ids(&r["prompt_ids"]);
    let o = open(&dir, 2, Isa::best());
    let inc = run_greedy(&o, &prompt, 24, false, 32);
    let full = run_greedy(&o, &prompt, 24, true, 32);
    assert_eq!(inc.generated_ids, full.generated_ids);
    assert!(bits(&inc.logits) == bits(&full.logits), "incremental and full-recompute logits differ");
    // Chunked prefill is the same computation too.
    for chunk in [1, 5, 7] {
        let c = run_greedy(&o, &prompt, 4, false, chunk);
        assert!(bits(&c.logits) == bits(&inc.logits[..4]), "prefill chunk {chunk} changed the logits");
    }
}

#[test]
fn output_is_bit_identical_across_threads_and_kernel_paths() {
    let dir = tiny_dir();
    let r = reference_json(&dir);
    let prompt = ids(&r["prompt_ids"]);
    let base = run_greedy(&open(&dir, 1, Isa::Scalar), &prompt, 24, false, 32);
    for isa in Isa::available() {
        for threads in [1, 2, 3] {
            let g = run_greedy(&open(&dir, threads, isa), &prompt, 24, false, 32);
            assert_eq!(g.generated_ids, base.generated_ids, "{isa:?} x {threads} threads");
            assert!(bits(&g.logits) == bits(&base.logits), "{isa:?} x {threads} threads changed logit bits");
        }
    }
    assert!(Isa::available().len() >= 2 || std::env::var_os("CI").is_none(), "CI machines have AVX2");
}

#[test]
fn every_block_matches_the_reference_intermediates() {
    let dir = tiny_dir();
    let r = reference_json(&dir);
    let refs = reference_tensors(&dir);
    let prompt = ids(&r["prompt_ids"]);
    let o = open(&dir, 2, Isa::best());
    let mut sess = o.engine.session(prompt.len(), prompt.len()).unwrap();
    let mut rec = Recorder::default();
    let logits = o.engine.prefill(&mut sess, &prompt, LogitRows::All, Some(&mut rec)).unwrap().to_vec();
    let mut report = Vec::new();
    let n_layers = o.engine.model.cfg.n_layers;
    for l in 0..n_layers {
        for what in ["attn_input", "attn_out", "mlp_input", "ffn_out", "partial"] {
            let name = format!("layers.{l}.{what}");
            let diff = rel_max_diff(&rec.tensors[&name], &refs[&name].data);
            report.push((name, diff));
        }
    }
    let snaps = &refs["snapshots"];
    let per_snap = snaps.data.len() / snaps.shape[0];
    for j in 0..snaps.shape[0] {
        let diff = rel_max_diff(&rec.tensors[&format!("snapshot.{j}")], &snaps.data[j * per_snap..(j + 1) * per_snap]);
        report.push((format!("snapshot.{j}"), diff));
    }
    report.push(("final_hidden".into(), rel_max_diff(&rec.tensors["final_hidden"], &refs["final_hidden"].data)));
    report.push(("logits_prompt".into(), rel_max_diff(&logits, &refs["logits_prompt"].data)));
    let worst = report.iter().cloned().fold(("".to_string(), 0.0f64), |a, b| if b.1 > a.1 { b } else { a });
    assert!(worst.1 <= INTERMEDIATE_REL_TOL, "worst block {} differs by {:e}; all: {report:?}", worst.0, worst.1);
    // The first layers must be far tighter: no amplification yet.
    for (name, diff) in &report[..5] {
        assert!(*diff <= 1e-5, "{name} differs by {diff:e}");
    }
    check_routes(&rec, &refs, &o.engine.model.cfg.moe_layers(), prompt.len(), o.engine.model.cfg.moe.top_k);
}

/// Router choices: the same set of experts per token; the same order wherever the biased scores
/// are separated by more than float32 noise; weights within 1e-4.
fn check_routes(rec: &Recorder, refs: &HashMap<String, RefTensor>, layers: &[usize], t: usize, k: usize) {
    for &l in layers {
        let idx = &refs[&format!("layers.{l}.router_indices")].data;
        let wts = &refs[&format!("layers.{l}.router_weights")].data;
        let gaps = &refs[&format!("layers.{l}.router_biased_topk1")].data;
        let got = &rec.routes[&l];
        assert_eq!(got.len(), t);
        for tok in 0..t {
            let want: Vec<usize> = idx[tok * k..(tok + 1) * k].iter().map(|&v| v as usize).collect();
            let mut a = got[tok].experts.clone();
            let mut b = want.clone();
            a.sort_unstable();
            b.sort_unstable();
            assert_eq!(a, b, "layer {l} token {tok}: expert set");
            for slot in 0..k {
                let separated = (slot == 0 || gaps[tok * (k + 1) + slot - 1] - gaps[tok * (k + 1) + slot] > 1e-4)
                    && gaps[tok * (k + 1) + slot] - gaps[tok * (k + 1) + slot + 1] > 1e-4;
                if separated {
                    assert_eq!(got[tok].experts[slot], want[slot], "layer {l} token {tok} slot {slot}: order");
                    let w = f64::from(got[tok].weights[slot]);
                    assert!((w - wts[tok * k + slot]).abs() < 1e-4, "layer {l} token {tok} slot {slot}: weight {w}");
                }
            }
        }
    }
}

#[test]
fn the_fixture_catches_every_spec_trap() {
    // Each trap of the spec, injected into the oracle, changes the teacher-forced argmax at some
    // positions; the engine matches the correct reference exactly (teacher-forcing test), so an
    // engine with any of these bugs would fail it.
    let r = reference_json(&tiny_dir());
    let correct = ids(&r["teacher_forced_argmax"]);
    let traps = r["traps"].as_object().unwrap();
    for name in ["nibble_swap", "bias_in_weights", "alog_per_channel", "latent_norm_per_expert", "v_l2norm"] {
        assert!(traps.contains_key(name), "trap {name} missing from the fixture");
    }
    for (name, t) in traps {
        if t["applicable"] == false {
            continue;
        }
        let bad = ids(&t["teacher_forced_argmax"]);
        let differing = bad.iter().zip(&correct).filter(|(a, b)| a != b).count();
        assert!(differing >= 3, "trap {name} changes only {differing} positions: the fixture is too weak");
        assert_eq!(differing as u64, t["differing_positions"].as_u64().unwrap(), "{name}");
    }
}

#[test]
fn prompt_beyond_the_vocabulary_is_refused() {
    let o = open(&tiny_dir(), 1, Isa::best());
    let err = o.engine.generate(&[1, 5000], &GenerateOptions::default(), |_| {}).unwrap_err();
    assert!(err.to_string().contains("token id 5000 is outside the vocabulary of 768"), "{err}");
}

#[test]
fn a_context_that_cannot_fit_in_memory_is_refused_up_front() {
    // A context length far beyond memory, so the memory check is what refuses.
    let (_tmp, model) = crate::checkpoint_tests::copy_tiny();
    let path = model.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["text_config"]["max_position_embeddings"] = (1u64 << 40).into();
    std::fs::write(&path, v.to_string()).unwrap();
    let o = open(&model, 1, Isa::best());
    let opts = GenerateOptions { gen: 4_000_000_000, ..Default::default() };
    let err = o.engine.generate(&[1, 2], &opts, |_| {}).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("positions need") && msg.contains("are available (limited by"), "{msg}");
}

/// Runs the oracle generator; `None` (after a visible notice) when Python or numpy is missing.
pub fn make_tiny(out: &Path, args: &[&str]) -> Option<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/make_tiny.py");
    let probe = std::process::Command::new("python3").args(["-c", "import numpy, tiktoken"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have python3 with numpy and tiktoken (.ci/run installs them)"
        );
        println!("SKIPPED: python3 with numpy and tiktoken is not available");
        return None;
    }
    let status = std::process::Command::new("python3").arg(&script).arg("--out").arg(out).args(args).status().unwrap();
    assert!(status.success(), "make_tiny.py {args:?} failed");
    Some(())
}

#[test]
fn a_model_with_other_seed_and_dims_matches_its_own_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let args = [
        "--seed",
        "7",
        "--layers",
        "14",
        "--hidden",
        "96",
        "--experts",
        "20",
        "--topk",
        "3",
        "--attn-res-block",
        "4",
        "--shards",
        "4",
    ];
    if make_tiny(dir, &args).is_none() {
        return;
    }
    let r = reference_json(dir);
    let refs = reference_tensors(dir);
    let prompt = ids(&r["prompt_ids"]);
    let o = open(dir, 2, Isa::best());
    assert_eq!(o.engine.model.cfg.n_layers, 14);
    let mut sess = o.engine.session(prompt.len(), prompt.len()).unwrap();
    let logits = o.engine.prefill(&mut sess, &prompt, LogitRows::All, None).unwrap().to_vec();
    let v = o.engine.model.cfg.vocab_size;
    let got: Vec<u32> = logits.chunks_exact(v).map(argmax).collect();
    assert_eq!(got, ids(&r["teacher_forced_argmax"]));
    let diff = rel_max_diff(&logits[(prompt.len() - 1) * v..], &refs["logits_last"].data);
    assert!(diff <= 1e-4, "last logits differ by {diff:e}");
    let want = ids(&r["greedy_ids"]);
    let g = run_greedy(&o, &prompt, want.len(), false, 32);
    assert_eq!(g.generated_ids, want);
}

/// The generator is deterministic: the model files it writes (config, weights, tokenizer, cases)
/// are byte-identical to the committed fixture. Its reference outputs (`reference.json`,
/// `reference.safetensors`) are float64 NumPy arithmetic whose last bits follow the NumPy
/// build's summation and BLAS kernels (NumPy 2.4.6 moved one f32 value of `layers.8.attn_input`
/// by 5e-9 relative and margins by 1e-13), so they must agree in every id, shape and name and in
/// every value to within far less than the engine's own tolerance against them (1e-4).
#[test]
fn the_oracle_reproduces_the_committed_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    if make_tiny(tmp.path(), &[]).is_none() {
        return;
    }
    let fixture = tiny_dir();
    let mut names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    for name in &names {
        match name.as_str() {
            "reference.json" => {
                let (fresh, committed) = (reference_json(tmp.path()), reference_json(&fixture));
                json_close(&fresh, &committed, "reference.json");
            }
            "reference.safetensors" => {
                let (fresh, committed) = (reference_tensors(tmp.path()), reference_tensors(&fixture));
                let mut keys: Vec<&String> = fresh.keys().collect();
                keys.sort();
                let mut committed_keys: Vec<&String> = committed.keys().collect();
                committed_keys.sort();
                assert_eq!(keys, committed_keys, "reference.safetensors: tensor names differ");
                for key in keys {
                    let (a, b) = (&fresh[key], &committed[key]);
                    assert_eq!(a.shape, b.shape, "reference.safetensors: {key}: shapes differ");
                    let scale = b.data.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
                    let diff = a.data.iter().zip(&b.data).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
                    assert!(diff <= 1e-6, "reference.safetensors: {key} differs by {diff:e} (relative)");
                }
            }
            _ => {
                let fresh = std::fs::read(tmp.path().join(name)).unwrap();
                let committed = std::fs::read(fixture.join(name)).unwrap_or_default();
                assert!(fresh == committed, "{name} differs from tests/fixtures/tiny-k3/{name}");
            }
        }
    }
    let committed =
        std::fs::read_dir(&fixture).unwrap().filter(|e| e.as_ref().unwrap().file_name() != "README.md").count();
    assert_eq!(committed, names.len(), "the fixture holds files the generator does not write");
}

/// `a` equals `b` in structure, strings, booleans and integers; floats agree to 1e-9 relative.
fn json_close(a: &serde_json::Value, b: &serde_json::Value, at: &str) {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let (mut kx, mut ky): (Vec<&String>, Vec<&String>) = (x.keys().collect(), y.keys().collect());
            kx.sort();
            ky.sort();
            assert_eq!(kx, ky, "{at}: keys differ");
            for k in kx {
                // `stats.f32_*` measure NumPy's own float32 arithmetic against float64: a property
                // of the NumPy build (1e-3 in one, 2e-3 in another), not of the generator.
                if k.starts_with("f32_") && x[k].is_f64() {
                    continue;
                }
                json_close(&x[k], &y[k], &format!("{at}.{k}"));
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{at}: lengths differ");
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                json_close(u, v, &format!("{at}[{i}]"));
            }
        }
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (u, v) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((u - v).abs() <= 1e-9 * v.abs().max(1e-30), "{at}: {u} against {v}");
        }
        _ => assert_eq!(a, b, "{at} differs"),
    }
}
