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
