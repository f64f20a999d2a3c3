//! Every refusal that names a fix names one that works: each test below makes the refusal,
//! follows its advice as written, and checks that the command then succeeds (issue 35).

use crate::checkpoint_tests::{copy_tiny, k3ring};
use crate::common::*;

/// The number after `before` in `text` (up to the next space).
fn number_after(text: &str, before: &str) -> String {
    let at = text.find(before).unwrap_or_else(|| panic!("no {before:?} in {text}")) + before.len();
    text[at..].split_whitespace().next().unwrap().to_owned()
}

fn run_streamed(model: &str, trunk: &str, extra: &[&str]) -> (i32, String, String) {
    k3ring(&[&["run", "-m", model, "--trunk", trunk, "--ids", "5,6,7", "-n", "2", "--ignore-eos"][..], extra].concat())
}

#[test]
fn a_budget_below_the_minimum_names_one_that_runs() {
    let (dir, trunk) = (tiny_dir(), pack(&tiny_dir()));
    let (d, t) = (dir.to_str().unwrap(), trunk.path().to_str().unwrap());
    let (code, _, err) = run_streamed(d, t, &["--mem-gb", "0.0001"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("raise the budget"), "{err}");
    let minimum = number_after(&err, "this model's minimum of ");
    let (code, _, err) = run_streamed(d, t, &["--mem-gb", &minimum]);
    assert_eq!(code, 0, "--mem-gb {minimum}: {err}");
}

#[test]
fn a_piece_below_the_smallest_names_one_that_runs() {
    let (dir, trunk) = (tiny_dir(), pack(&tiny_dir()));
    let (d, t) = (dir.to_str().unwrap(), trunk.path().to_str().unwrap());
    let (code, _, err) = run_streamed(d, t, &["--mem-gb", "0.002", "--piece-mb", "0.000001"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("raise it"), "{err}");
    let smallest = number_after(&err, "smallest piece of ");
    let (code, _, err) = run_streamed(d, t, &["--mem-gb", "0.002", "--piece-mb", &smallest]);
    assert_eq!(code, 0, "--piece-mb {smallest}: {err}");
}

#[test]
fn a_missing_or_foreign_pack_names_the_pack_command_that_mends_it() {
    let dir = tiny_dir();
    let d = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("trunk");
    std::fs::create_dir(&t).unwrap();
    let t = t.to_str().unwrap();
    // No pack there: the advice is `k3ring pack --model ... --out DIR`.
    let (code, _, err) = run_streamed(d, t, &["--mem-gb", "0.01"]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains(&format!("run `k3ring pack --model ... --out {t}`")), "{err}");
    let (code, _, err) = k3ring(&["pack", "--model", d, "--out", t]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run_streamed(d, t, &["--mem-gb", "0.01"]);
    assert_eq!(code, 0, "{err}");
    // Another checkpoint's pack: the same command with this model mends it.
    let (_other_tmp, other) = copy_tiny();
    let cfg = other.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replacen('{', "{\"k3ring_test_marker\": 1, ", 1)).unwrap();
    let o = other.to_str().unwrap();
    let (code, _, err) = run_streamed(o, t, &["--mem-gb", "0.01"]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("made from another checkpoint (or the checkpoint changed since): run `k3ring pack --model ... --out {t}` again")), "{err}");
    let (code, _, err) = k3ring(&["pack", "--model", o, "--out", t]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run_streamed(o, t, &["--mem-gb", "0.01"]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_streaming_flag_without_a_trunk_names_the_flag_that_runs_it() {
    let (dir, trunk) = (tiny_dir(), pack(&tiny_dir()));
    let (d, t) = (dir.to_str().unwrap(), trunk.path().to_str().unwrap());
    let (code, _, err) = k3ring(&["run", "-m", d, "--ids", "5,6", "-n", "2", "--mem-gb", "0.01"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("add --trunk DIR or drop the flag"), "{err}");
    let (code, _, err) = k3ring(&["run", "-m", d, "--ids", "5,6", "-n", "2", "--mem-gb", "0.01", "--trunk", t]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = k3ring(&["run", "-m", d, "--ids", "5,6", "-n", "2"]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_prompt_too_long_for_the_context_names_a_gen_that_fits() {
    let dir = tiny_dir();
    let d = dir.to_str().unwrap();
    let cfg = k3ring::config::Config::from_model_dir(&dir).unwrap();
    let context = cfg.context_length.expect("the tiny model states its context").positions;
    let (code, _, err) = k3ring(&["run", "-m", d, "--ids", "5,6,7", "-n", &context.to_string(), "--ignore-eos"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("shorten the prompt or lower --gen"), "{err}");
    let fits = (context - 3).to_string();
    let (code, _, err) =
        k3ring(&["run", "-m", d, "--ids", "5,6,7", "-n", &fits, "--ignore-eos", "--json", "/dev/null"]);
    assert_eq!(code, 0, "-n {fits}: {err}");
}
