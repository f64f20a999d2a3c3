//! The smallest budget (issue 14): units streamed in pieces (row blocks of each matrix) and an
//! expert pool below top-k give the resident run's bits at the planner's minimum, with pieces
//! that split every matrix and with pieces that split none; one byte below the minimum is
//! refused with the numbers.

use std::path::Path;

use k3ring::engine::{open_streaming, GenerateOptions, Generation, StreamingRun};
use k3ring::pipeline::{IoOptions, PipelineOptions};
use k3ring::storage::plan::Plan;
use k3ring::storage::stream::{StoreOptions, StreamStats};
use kernels::{Isa, Kernels};

use crate::checkpoint_tests::k3ring;
use crate::common::*;

const GEN: usize = 6;

fn run_options(budget: u64, piece: Option<u64>, prompt_len: usize) -> StreamingRun {
    StreamingRun {
        budget_bytes: budget,
        sequences: 1,
        context: prompt_len + GEN,
        chunk: 8,
        threads: 2,
        store: StoreOptions { piece_bytes: piece, ..StoreOptions::default() },
        pipeline: PipelineOptions { io: IoOptions::default(), ..PipelineOptions::default() },
        prefetch_window: None,
        placement: None,
        trace_detail: false,
        trunk_share: None,
        available_memory: None,
        drafting: Default::default(),
    }
}

fn generate(
    model: &Path,
    trunk: &Path,
    run: &StreamingRun,
    ids: &[u32],
) -> Result<(Generation, Plan, StreamStats), String> {
    let (o, plan) = open_streaming(model, trunk, run, Kernels::with_isa(Isa::best()).unwrap(), |_| {})
        .map_err(|e| e.to_string())?;
    let opts = GenerateOptions { gen: GEN, keep_logits: true, prefill_chunk: 8, ..Default::default() };
    let g = o
        .engine
        .generate(ids, &opts, |_| {})
        .map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e).map(|s| s.to_string())))?;
    Ok((g, plan, o.engine.src.stats()))
}

fn resident(model: &Path, ids: &[u32]) -> Generation {
    let o = open(model, 2, Isa::best());
    let opts = GenerateOptions { gen: GEN, keep_logits: true, prefill_chunk: 8, ..Default::default() };
    o.engine.generate(ids, &opts, |_| {}).unwrap()
}

fn assert_same(a: &Generation, b: &Generation, what: &str) {
    let bits = |g: &Generation| g.logits.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(a.generated_ids, b.generated_ids, "{what}: ids differ from the resident run");
    assert!(bits(a) == bits(b), "{what}: logits differ from the resident run");
}

/// The plan of a run with a large budget (its minimum is what the planner accepts at least).
fn plan_for(model: &Path, trunk: &Path, piece: Option<u64>, prompt_len: usize) -> Plan {
    let run = run_options(4_000_000_000, piece, prompt_len);
    let (_, plan) = open_streaming(model, trunk, &run, Kernels::with_isa(Isa::best()).unwrap(), |_| {}).unwrap();
    plan
}

/// At the minimum budget of each piece size: the resident bits. Returns the pieces per token at
/// each size.
fn check_piece_sizes(model: &Path, ids: &[u32], pieces: &[Option<u64>]) -> Vec<usize> {
    let trunk = pack(model);
    let base = resident(model, ids);
    let mut counts = Vec::new();
    for &piece in pieces {
        let min = plan_for(model, trunk.path(), piece, ids.len()).minimum_bytes;
        let (g, plan, stats) = generate(model, trunk.path(), &run_options(min, piece, ids.len()), ids).unwrap();
        let what = format!("piece {piece:?} at the minimum budget ({})", plan.describe());
        assert_same(&g, &base, &what);
        assert!(plan.planned_bytes <= min, "{what}");
        assert!(!plan.split.is_empty() && stats.trunk_pieces > 0, "{what}: nothing was split");
        assert!(plan.pinned.is_empty(), "{what}");
        counts.push(stats.trunk_pieces);
    }
    counts
}

#[test]
fn the_minimum_budget_streams_in_pieces_with_fewer_expert_slots_than_top_k() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let ids = prompt();
    let base = resident(&model, &ids);
    let plan = plan_for(&model, trunk.path(), None, ids.len());
    let min = plan.minimum_bytes;
    let (g, plan, stats) = generate(&model, trunk.path(), &run_options(min, None, ids.len()), &ids).unwrap();
    assert_same(&g, &base, &plan.describe());
    assert!(plan.piece_bytes.is_some() && stats.trunk_split_units > 0, "{}", plan.describe());
    let top_k = 4;
    assert!(plan.expert_slots < top_k, "the minimum pool is below top-k: {}", plan.describe());
    assert!(stats.expert_reads > 0 && stats.expert_evictions > 0);
    // One byte less is refused, with the minimum and its parts.
    let err = generate(&model, trunk.path(), &run_options(min - 1, None, ids.len()), &ids).unwrap_err();
    assert!(err.contains("below this model's minimum"), "{err}");
    // The minimum is printed rounded up, so the number shown is a budget that works.
    let shown = format!("{:.4} GB", (min as f64 / 1e9 * 1e4).ceil() / 1e4);
    assert!(err.contains(&shown), "{shown} in {err}");
    assert!(err.contains("pieces of") && err.contains("expert slots"), "{err}");
}

#[test]
fn tiny_model_pieces_that_split_every_matrix_or_none_give_the_resident_bits() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let plan = plan_for(&model, trunk.path(), None, prompt().len());
    let smallest = plan.min_piece_bytes.unwrap();
    // The tiny model's largest matrix is lm_head (768 x 64 bf16): a piece of it splits none.
    let whole_matrices = 768 * 64 * 2;
    let counts = check_piece_sizes(&model, &prompt(), &[Some(smallest), Some(3 * smallest), Some(whole_matrices)]);
    assert!(counts[0] > counts[2], "smaller pieces make more of them: {counts:?}");
}

#[test]
fn small_synth_model_pieces_give_the_resident_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("small");
    let s = dir.to_str().unwrap();
    let (code, _, err) =
        k3ring(&["synth", "--dims", "small", "--layers", "4", "--experts", "8", "--top-k", "4", "--out", s]);
    assert_eq!(code, 0, "{err}");
    let ids: Vec<u32> = (1..12).map(|i| i * 37).collect();
    let trunk = pack(&dir);
    let plan = plan_for(&dir, trunk.path(), None, ids.len());
    let smallest = plan.min_piece_bytes.unwrap();
    // Pieces of the smallest size split every matrix with more rows than its granule; pieces of
    // the largest matrix (the dense layer's down_proj, 1792 x 8448 bf16) split none.
    let largest_matrix = 1792 * 8448 * 2;
    let counts = check_piece_sizes(&dir, &ids, &[None, Some(smallest), Some(largest_matrix)]);
    assert!(counts[1] > counts[2], "{counts:?}");
}

#[test]
fn a_piece_below_the_smallest_is_refused_naming_the_flag() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let (code, _, err) = k3ring(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--trunk",
        trunk.path().to_str().unwrap(),
        "--mem-gb",
        "1",
        "--piece-mb",
        "0.000001",
        "--ids",
        "1,2,3",
        "--gen",
        "1",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--piece-mb") && err.contains("smallest piece"), "{err}");
}

/// The real K3's minimum budget by the planner's own rule (docs/STORAGE.md, "The smallest
/// budget"): the release config's trunk units as `k3ring pack` lays them out, each matrix's
/// granule block as the smallest piece, and the states, scratch and expert slots a `run` at
/// that context plans. Prints the table the docs quote.
#[test]
fn release_k3_minimum_budget_from_the_planner() {
    use k3ring::checkpoint::Dtype;
    use k3ring::config::Config;
    use k3ring::model::{ModelState, Scratch};
    use k3ring::pipeline::prefetcher::Prefetcher;
    use k3ring::storage::pack::{plan_units, PackUnit};
    use k3ring::storage::plan::{PieceInput, PlanInput};
    use k3ring::storage::stream::{embed_buffer_bytes, expert_slot_bytes};

    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3-config.json");
    let cfg = Config::from_json_str(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    assert_eq!((cfg.n_layers, cfg.vocab_size), (93, 163_840));
    let align = 4096u64;
    let (mut units, mut small, mut min_piece) = (Vec::new(), Vec::new(), 0u64);
    for (unit, tensors) in plan_units(&cfg) {
        if unit == PackUnit::Embed {
            continue;
        }
        let mut len = 0u64;
        let mut unit_small = 0u64;
        for t in &tensors {
            let shape = &t.shapes[0];
            let bytes = shape.iter().product::<u64>() * t.dtype.size();
            len += bytes;
            if t.dtype == Dtype::Bf16 && shape.len() == 2 && shape[0] > 1 {
                // kv_b_proj is read by whole heads; every other matrix by 64 rows.
                let granule = if t.name.ends_with("kv_b_proj.weight") {
                    (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim) as u64
                } else {
                    64
                };
                min_piece = min_piece.max(granule.min(shape[0]) * shape[1] * 2);
            } else {
                unit_small += bytes.div_ceil(64) * 64;
            }
        }
        units.push((unit, len.div_ceil(align) * align));
        small.push((unit, unit_small));
    }
    // The smallest piece: 64 rows of the dense layer's down_proj ([7168, 33792] bf16).
    assert_eq!(min_piece, 64 * 33_792 * 2);
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/STORAGE.md")).unwrap();
    let chunk = 32;
    println!("| context | states and KV cache | scratch | trunk slots (4 pieces) | norms and biases | expert slots (2) | minimum |");
    println!("|---|---|---|---|---|---|---|");
    let mut last = 0;
    for context in [4096usize, 32_768, 131_072] {
        let logits = 4 * (chunk * cfg.vocab_size) as u64;
        let scratch = Scratch::bytes(&cfg, chunk, context)
            + Prefetcher::scratch_bytes(&cfg, chunk)
            + logits
            + embed_buffer_bytes(&cfg, chunk, align);
        let input = PlanInput {
            budget: 0,
            mem_available: None,
            units: units.clone(),
            expert_slot_bytes: expert_slot_bytes(&cfg, align),
            experts_total: cfg.n_layers * cfg.moe.n_experts,
            top_k: cfg.moe.top_k,
            prefetch_window: cfg.moe.top_k,
            readahead: 1,
            states_bytes: ModelState::bytes(&cfg, context),
            sequences: 1,
            scratch_bytes: scratch,
            trunk_share: None,
            pieces: Some(PieceInput {
                small_bytes: small.clone(),
                min_piece_bytes: min_piece,
                slack_bytes: 2 * align,
                forced: None,
            }),
            spread_pins: false,
        };
        let err = k3ring::storage::plan::Plan::make(&input).unwrap_err().to_string();
        let min: f64 = err.split("minimum of ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        let budget = (min * 1e9) as u64;
        let plan = k3ring::storage::plan::Plan::make(&PlanInput { budget, ..input.clone() }).unwrap();
        let gb = |b: u64| format!("{:.3} GB", b as f64 / 1e9);
        println!(
            "| {context} | {} | {} | {} | {} | {} | {} |",
            gb(plan.states_bytes),
            gb(plan.scratch_bytes),
            gb(plan.ring_slots as u64 * plan.ring_slot_bytes),
            gb(plan.small_bytes),
            gb(plan.expert_slots as u64 * plan.expert_slot_bytes),
            gb(plan.planned_bytes)
        );
        assert_eq!(plan.split.len(), cfg.n_layers + 1, "every unit is split at the smallest piece");
        let row = format!(
            "| {context} | {} | {} | {} | {} | {} | {} |",
            gb(plan.states_bytes),
            gb(plan.scratch_bytes),
            gb(plan.ring_slots as u64 * plan.ring_slot_bytes),
            gb(plan.small_bytes),
            gb(plan.expert_slots as u64 * plan.expert_slot_bytes),
            gb(plan.planned_bytes)
        );
        assert!(docs.contains(&row), "docs/STORAGE.md lacks the planner's row {row}");
        assert!(plan.planned_bytes <= budget && plan.planned_bytes > last);
        last = plan.planned_bytes;
    }
}

/// A damaged split unit is caught by the pass at open, naming the unit (exit 3).
#[test]
fn a_damaged_split_unit_is_a_data_error_naming_the_unit() {
    let trunk = pack(&tiny_dir());
    // At the minimum for pieces of 20 kB nothing is pinned: layer.5 is split.
    let min = plan_for(&tiny_dir(), trunk.path(), Some(20_000), 3).minimum_bytes;
    let run = run_options(min, Some(20_000), 3);
    let (_, plan) =
        open_streaming(&tiny_dir(), trunk.path(), &run, Kernels::with_isa(Isa::best()).unwrap(), |_| {}).unwrap();
    assert!(plan.split.contains(&"layer.5".to_owned()), "{}", plan.describe());
    let mem_gb = format!("{:.9}", min.div_ceil(1000) as f64 / 1e6);
    let manifest = k3ring::storage::pack::Manifest::load(trunk.path()).unwrap();
    let unit = manifest.units.iter().find(|u| u.unit == "layer.5").unwrap();
    let path = trunk.path().join("trunk.pack");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(unit.offset + unit.len / 2) as usize] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    let (code, _, err) = k3ring(&[
        "run",
        "--model",
        tiny_dir().to_str().unwrap(),
        "--trunk",
        trunk.path().to_str().unwrap(),
        "--mem-gb",
        &mem_gb,
        "--piece-mb",
        "0.02",
        "--ids",
        "1,2,3",
        "--gen",
        "2",
        // The minimum above is planned without drafting's journal.
        "--no-draft",
    ]);
    assert_eq!(code, 3, "{err}");
    // Caught while opening (the pass over split units), not by a piece's first read.
    assert!(err.contains("opening model") && err.contains("unit layer.5 fails its checksum"), "{err}");
}

/// Pieces read after open are checked against the checksums the pass at open recorded: with
/// the simulator corrupting reads of the pack and `verify_every_read`, every run gives the
/// resident bits or stops on a named checksum error, and some stop on a piece's.
#[test]
fn corrupted_piece_reads_end_in_a_checksum_error_naming_the_rows() {
    use k3ring::pipeline::IoKind;
    use k3ring::storage::io::sim::SimOptions;
    let model = tiny_dir();
    let trunk = pack(&model);
    let ids = prompt();
    let base = resident(&model, &ids);
    let min = plan_for(&model, trunk.path(), None, ids.len()).minimum_bytes;
    let shards = k3ring::checkpoint::CheckpointIndex::open(&model).unwrap().shards.len();
    let mut piece_errors = 0;
    for seed in 1..=10 {
        let mut sim = SimOptions::fault_free(seed);
        sim.latency_max = 20;
        sim.corrupt_ppm = 3_000;
        sim.corruptible_files = vec![shards];
        let mut run = run_options(min, None, ids.len());
        run.pipeline.io = IoOptions { kind: IoKind::Sim, sim: Some(sim), ..IoOptions::default() };
        run.store.verify_every_read = true;
        match generate(&model, trunk.path(), &run, &ids) {
            Ok((g, _, _)) => assert_same(&g, &base, &format!("seed {seed}")),
            Err(e) => {
                assert!(e.contains("checksum") && e.contains("trunk"), "seed {seed}: {e}");
                piece_errors += usize::from(e.contains(", rows ") && e.contains("changed while in use"));
            }
        }
    }
    assert!(piece_errors > 0, "no corrupted piece read was caught after open");
}

/// `--trunk-pins spread` (issue 29): at a budget that pins about half the trunk, that trunk held
/// as pieces of every unit (routers first, the rest spread over the token) gives the resident
/// bits, and after open the ring reads only the pieces that are not pinned.
#[test]
fn spread_pins_give_the_resident_bits_and_read_no_pinned_piece_after_open() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let ids = prompt();
    let base = resident(&model, &ids);
    let whole_trunk = plan_for(&model, trunk.path(), None, ids.len()).pinned_bytes;
    let smallest = plan_for(&model, trunk.path(), None, ids.len()).min_piece_bytes.unwrap();
    let at_min = plan_for(&model, trunk.path(), Some(smallest), ids.len());
    let slots = k3ring::storage::plan::SPREAD_RING_SLOTS as u64 * at_min.ring_slot_bytes;
    // The minimum, the spread ring, the preferred pool (top-k 4 + a window of 4) and half the trunk.
    let pool = 8 * at_min.expert_slot_bytes;
    let mut run = run_options(at_min.minimum_bytes + slots + pool + whole_trunk / 2, Some(smallest), ids.len());
    run.store.spread_pins = true;
    let (o, plan) = open_streaming(&model, trunk.path(), &run, Kernels::with_isa(Isa::best()).unwrap(), |_| {})
        .map_err(|e| e.to_string())
        .unwrap();
    let what = plan.describe();
    assert!(plan.pinned_piece_bytes > whole_trunk / 4 && plan.pinned.is_empty(), "{what}");
    let opts = GenerateOptions { gen: GEN, keep_logits: true, prefill_chunk: 8, ..Default::default() };
    let first = o.engine.generate(&ids, &opts, |_| {}).unwrap();
    assert_same(&first, &base, &what);
    let before = o.engine.src.stats();
    let again = o.engine.generate(&ids, &opts, |_| {}).unwrap();
    assert_same(&again, &base, &what);
    let after = o.engine.src.stats();
    assert!(after.trunk_pinned_pieces > 0 && after.trunk_pinned_pieces < after.trunk_pieces, "{what}");
    // Each pass reads each streamed item at most once; pinned pieces never.
    let passes = ids.len().div_ceil(8) + GEN;
    let whole_streamed = after.trunk_streamed_units - after.trunk_split_units;
    let streamed_items = after.trunk_pieces - after.trunk_pinned_pieces + whole_streamed;
    let reads = after.trunk_reads - before.trunk_reads;
    assert!(reads > 0 && reads <= (passes * streamed_items) as u64, "{reads} reads in {passes} passes: {what}");
}
