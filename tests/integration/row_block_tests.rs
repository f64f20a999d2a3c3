//! Trunk matrices consumed in row blocks (issue 14, "the smallest budget"): a store may hand a
//! bf16 matrix over in pieces, never whole. A wrapper over the in-memory store splits every
//! matrix the model declares ([`LayerWeights::streamed`], [`GlobalWeights::head_streamed`]) into
//! row blocks of varying sizes, refuses whole-matrix reads of them, and records the order they
//! are read in. The logits must be the unwrapped model's bits, and the order the declared one.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use k3ring::model::weights::{Mat, SourceError, Streamed, TensorId, TrunkUnit, TrunkView, WeightSource};
use k3ring::model::{LogitRows, Model, ModelError, ModelState, NoHook, Scratch, Segment};
use k3ring::storage::mmap::{MappedExpert, MmapSource};
use kernels::Isa;

use crate::common::*;

/// How a view misbehaves, to show the checks would catch it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Hands the second block's bytes under the first block's rows (same length): a mis-offset.
    SwapFirstBlocks,
    /// Stops before the matrix's last block.
    DropLastBlock,
}

/// The in-memory store, with every declared matrix handed over only in row blocks.
struct Blocked<'a> {
    inner: &'a MmapSource,
    /// Every declared matrix: its unit and granule.
    declared: HashMap<TensorId, (TrunkUnit, Streamed)>,
    /// (unit, matrix) of every `row_blocks` call, in order.
    log: Mutex<Vec<(TrunkUnit, TensorId)>>,
    /// Seeds the split pattern; advanced by every call.
    calls: AtomicU64,
    /// Calls split into more than one block.
    split_calls: AtomicU64,
    fault: Fault,
}

impl<'a> Blocked<'a> {
    fn new(model: &Model, inner: &'a MmapSource, fault: Fault) -> Blocked<'a> {
        let mut declared = HashMap::new();
        for (l, lw) in model.weights.layers.iter().enumerate() {
            for s in lw.streamed(&model.cfg) {
                assert!(declared.insert(s.mat.id, (TrunkUnit::Layer(l), s)).is_none(), "declared twice");
            }
        }
        for s in model.weights.globals.head_streamed() {
            assert!(declared.insert(s.mat.id, (TrunkUnit::Head, s)).is_none(), "declared twice");
        }
        Blocked {
            inner,
            declared,
            log: Mutex::new(Vec::new()),
            calls: AtomicU64::new(0),
            split_calls: AtomicU64::new(0),
            fault,
        }
    }

    fn take_log(&self) -> Vec<(TrunkUnit, TensorId)> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

/// SplitMix64 step: the split pattern's randomness.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct BlockedView<'a> {
    src: &'a Blocked<'a>,
    unit: TrunkUnit,
}

impl TrunkView for BlockedView<'_> {
    fn bytes(&self, id: TensorId) -> &[u8] {
        assert!(!self.src.declared.contains_key(&id), "bytes() of tensor {id}, a matrix declared as streamed");
        self.src.inner.bytes(id)
    }

    fn row_blocks(&self, mat: &Mat, f: &mut dyn FnMut(Range<usize>, &[u8])) -> Result<(), SourceError> {
        let &(unit, s) = self.src.declared.get(&mat.id).unwrap_or_else(|| panic!("tensor {} is not declared", mat.id));
        assert_eq!(unit, self.unit, "tensor {} read through the view of another unit", mat.id);
        assert_eq!((s.mat.rows, s.mat.cols), (mat.rows, mat.cols));
        self.src.log.lock().unwrap().push((self.unit, mat.id));
        let all = self.src.inner.bytes(mat.id);
        let row_bytes = 2 * mat.cols;
        // One call in four gets the whole matrix; the others blocks of 1 to 3 granules each.
        let mut r = mix(0x5EED ^ self.src.calls.fetch_add(1, Ordering::Relaxed));
        let whole = r.is_multiple_of(4);
        let mut blocks = Vec::new();
        let mut start = 0;
        while start < mat.rows {
            r = mix(r);
            let n = if whole { mat.rows } else { s.granule * (1 + (r % 3) as usize) };
            let end = (start + n).min(mat.rows);
            blocks.push(start..end);
            start = end;
        }
        if blocks.len() > 1 {
            self.src.split_calls.fetch_add(1, Ordering::Relaxed);
        }
        let bytes_of = |b: &Range<usize>| &all[b.start * row_bytes..b.end * row_bytes];
        match self.src.fault {
            Fault::SwapFirstBlocks if blocks.len() > 1 && blocks[0].len() == blocks[1].len() => {
                f(blocks[0].clone(), bytes_of(&blocks[1]));
                f(blocks[1].clone(), bytes_of(&blocks[0]));
                blocks.drain(..2);
            }
            Fault::DropLastBlock => {
                blocks.pop();
            }
            _ => {}
        }
        for b in blocks {
            f(b.clone(), bytes_of(&b));
        }
        Ok(())
    }
}

impl WeightSource for Blocked<'_> {
    type Trunk<'b>
        = BlockedView<'b>
    where
        Self: 'b;
    type Expert<'b>
        = MappedExpert<'b>
    where
        Self: 'b;

    fn trunk(&self, unit: TrunkUnit) -> Result<BlockedView<'_>, SourceError> {
        Ok(BlockedView { src: self, unit })
    }

    fn embed_rows(&self, table: &Mat, ids: &[u32], out: &mut [u8]) -> Result<(), SourceError> {
        self.inner.embed_rows(table, ids, out)
    }

    fn expert(&self, layer: usize, expert: usize) -> Result<MappedExpert<'_>, SourceError> {
        self.inner.expert(layer, expert)
    }
}

/// The declared reading order of one forward pass: every layer's `streamed()`, then the head's.
fn declared_order(model: &Model) -> Vec<(TrunkUnit, TensorId)> {
    let mut v = Vec::new();
    for (l, lw) in model.weights.layers.iter().enumerate() {
        v.extend(lw.streamed(&model.cfg).iter().map(|s| (TrunkUnit::Layer(l), s.mat.id)));
    }
    v.extend(model.weights.globals.head_streamed().iter().map(|s| (TrunkUnit::Head, s.mat.id)));
    v
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One step of several sequences: `lens[i]` tokens of sequence i, all logits.
struct Step {
    tokens: Vec<u32>,
    segments: Vec<Segment>,
}

impl Step {
    fn new(lens: &[usize], step: usize, vocab: usize) -> Step {
        let mut tokens = Vec::new();
        let mut segments = Vec::new();
        for (slot, &n) in lens.iter().enumerate() {
            let begin = tokens.len();
            tokens.extend((0..n).map(|j| ((step * 131 + slot * 37 + j * 11 + 5) % vocab) as u32));
            segments.push(Segment { slot, rows: begin..tokens.len() });
        }
        Step { tokens, segments }
    }
}

/// Runs the same steps on `plain` and on `blocked`, comparing logits bit for bit and the order
/// of the blocked reads with the declared order after every step. `steps[i]` lists the token
/// count of each sequence in step i. Returns the first error of the blocked run, if any.
fn run_steps<S: WeightSource>(
    model: &Model,
    plain: &S,
    blocked: &Blocked<'_>,
    steps: &[Vec<usize>],
    compare: bool,
) -> Result<bool, ModelError> {
    let (cfg, vocab) = (&model.cfg, model.cfg.vocab_size);
    let seqs = steps[0].len();
    let chunk = steps.iter().map(|s| s.iter().sum::<usize>()).max().unwrap();
    let mut states: [Vec<ModelState>; 2] =
        std::array::from_fn(|_| (0..seqs).map(|_| ModelState::new(cfg, 64)).collect());
    let mut scratch: [Scratch; 2] = std::array::from_fn(|_| Scratch::new(cfg, chunk, 64));
    let want_order = declared_order(model);
    let mut all_equal = true;
    for (i, lens) in steps.iter().enumerate() {
        let step = Step::new(lens, i, vocab);
        let rows: Vec<usize> = (0..step.tokens.len()).collect();
        let mut logits = [vec![0.0f32; rows.len() * vocab], vec![0.0f32; rows.len() * vocab]];
        let [s0, s1] = &mut states;
        let [c0, c1] = &mut scratch;
        let [l0, l1] = &mut logits;
        model.forward_batch(plain, &NoHook, s0, &step.segments, c0, &step.tokens, &rows, l0, None).unwrap();
        model.forward_batch(blocked, &NoHook, s1, &step.segments, c1, &step.tokens, &rows, l1, None)?;
        let log = blocked.take_log();
        assert_eq!(log, want_order, "step {i} ({lens:?}): matrices read out of the declared order, or not once each");
        if compare {
            assert_eq!(bits(l0), bits(l1), "step {i} ({lens:?}): logits differ from the whole-matrix run");
        }
        all_equal &= bits(l0) == bits(l1);
    }
    Ok(all_equal)
}

/// Decode (one token at a time, several steps), a prefill chunk and batch steps of several
/// sequences at different positions; the split counts show the blocks really split matrices.
fn check_model(dir: &Path, what: &str) {
    let o = open(dir, 2, Isa::best());
    let (model, plain) = (&o.engine.model, &o.engine.src);
    let blocked = Blocked::new(model, plain, Fault::None);
    let decode: Vec<Vec<usize>> = (0..6).map(|_| vec![1]).collect();
    let prefill = vec![vec![7], vec![5], vec![1]];
    let batch = vec![vec![3, 1, 5], vec![1, 1, 1], vec![2, 4, 1], vec![1, 1, 1]];
    for (name, steps) in [("decode", &decode), ("prefill", &prefill), ("batch", &batch)] {
        let before = blocked.split_calls.load(Ordering::Relaxed);
        assert!(run_steps(model, plain, &blocked, steps, true).unwrap(), "{what} {name}");
        let split = blocked.split_calls.load(Ordering::Relaxed) - before;
        let calls = steps.len() * declared_order(model).len();
        eprintln!("{what} {name}: {split} of {calls} matrix reads came in more than one block");
        assert!(split > 0, "{what} {name}: no matrix was split, so the test shows nothing");
    }
    // Which matrices can split at all (more rows than their granule).
    let splittable = blocked.declared.values().filter(|(_, s)| s.mat.rows > s.granule).count();
    eprintln!("{what}: {splittable} of {} declared matrices have more rows than their granule", blocked.declared.len());

    // The comparison sees a mis-offset block: swapped bytes change the logits.
    let swapped = Blocked::new(model, plain, Fault::SwapFirstBlocks);
    assert!(!run_steps(model, plain, &swapped, &prefill, false).unwrap(), "{what}: swapped blocks went unnoticed");
    // A view that leaves rows out is an error, not stale output or a panic.
    let short = Blocked::new(model, plain, Fault::DropLastBlock);
    match run_steps(model, plain, &short, &decode, false) {
        Err(ModelError::Source(SourceError::Internal(m))) => assert!(m.contains("stopped at row"), "{m}"),
        other => panic!("{what}: a view that stops early gave {:?}", other.map(|_| ())),
    }
}

#[test]
fn row_blocks_give_the_whole_matrix_logits_in_the_declared_order_tiny() {
    check_model(&tiny_dir(), "tiny");
}

#[test]
fn row_blocks_give_the_whole_matrix_logits_in_the_declared_order_synth() {
    let dir = tempfile::tempdir().unwrap();
    let opts = k3ring::synth::SynthOptions {
        seed: 5,
        ..k3ring::synth::SynthOptions::preset(dir.path().to_path_buf(), k3ring::synth::DimsPreset::Tiny)
    };
    k3ring::synth::synth(&opts, &|_, _| {}).unwrap();
    check_model(dir.path(), "synth");
}

/// `Model::forward` (one sequence, the entry `generate` uses): the prompt as one chunk, then
/// single tokens; logits of the last row each time.
fn forward_pieces<S: WeightSource>(model: &Model, src: &S, check: impl Fn()) -> Vec<Vec<u32>> {
    let cfg = &model.cfg;
    let prompt = prompt();
    let mut st = ModelState::new(cfg, 64);
    let mut sc = Scratch::new(cfg, prompt.len(), 64);
    let mut logits = vec![0.0f32; cfg.vocab_size];
    let mut got = Vec::new();
    for piece in [&prompt[..], &prompt[..1], &prompt[1..2]] {
        model.forward(src, &NoHook, &mut st, &mut sc, piece, LogitRows::Last, &mut logits, None).unwrap();
        check();
        got.push(bits(&logits));
    }
    got
}

#[test]
fn single_sequence_forward_reads_blocks_in_the_declared_order() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let (model, plain) = (&o.engine.model, &o.engine.src);
    let blocked = Blocked::new(model, plain, Fault::None);
    let want = forward_pieces(model, plain, || ());
    let got = forward_pieces(model, &blocked, || assert_eq!(blocked.take_log(), declared_order(model)));
    assert_eq!(got, want, "logits of the blocked run differ");
}
