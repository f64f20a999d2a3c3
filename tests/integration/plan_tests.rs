//! `k3ring plan`: the sizing table from a config alone agrees with the plan a real run of the
//! same model makes (its minimum, its trunk, its pool), and the release's config gives a table.

use k3ring::engine::{open_streaming, DraftPlan, StreamingRun};
use kernels::{Isa, Kernels};
use serde_json::Value;

use super::batch_tests::streaming_run;
use super::checkpoint_tests::k3ring;
use super::common::{pack, tiny_dir};

fn table(args: &[&str]) -> Value {
    let (code, out, err) = k3ring(&[&["plan", "--json", "-"][..], args].concat());
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn the_table_from_a_config_matches_the_plan_of_a_packed_run() {
    let config = tiny_dir().join("config.json");
    let t = table(&["--config", config.to_str().unwrap(), "--context", "64", "--budgets", "0.004,1"]);
    // The run `plan` sizes: what `run` plans for one greedy sequence of 64 positions, prefill
    // chunk 32, default drafting (an optional journal of 9 rows).
    let trunk = pack(&tiny_dir());
    let opened = |budget: u64, drafting: DraftPlan| {
        let run = StreamingRun { chunk: 32, drafting, ..streaming_run(budget, 1) };
        let kernels = Kernels::with_isa(Isa::Scalar).unwrap();
        open_streaming(&tiny_dir(), trunk.path(), &run, kernels, |_| {}).map_err(|e| e.to_string()).unwrap().1
    };
    let plan = |budget: u64| opened(budget, DraftPlan { rows: 9, sequences: 1, step_rows: 0, optional: true });
    let roomy = plan(1_000_000_000);
    // The minimum is the run's without drafting, which default drafting yields to.
    let plain = opened(1_000_000_000, DraftPlan::default());
    assert_eq!(t["minimum_bytes"].as_u64().unwrap(), plain.minimum_bytes, "{t}");
    assert!(plain.minimum_bytes < roomy.minimum_bytes);
    assert_eq!(t["trunk_bytes"].as_u64().unwrap(), roomy.pinned_bytes, "{t}");
    let manifest = k3ring::storage::pack::Manifest::load(trunk.path()).unwrap();
    let packed: u64 = manifest.units.iter().filter(|u| u.unit != "embed").map(|u| u.len).sum();
    assert_eq!(t["trunk_bytes"].as_u64().unwrap(), packed, "the whole trunk but the embedding");
    let rows = t["rows"].as_array().unwrap();
    for (row, budget) in rows.iter().zip([4_000_000u64, 1_000_000_000]) {
        let real = plan(budget);
        assert_eq!(row["budget_bytes"].as_u64().unwrap(), budget);
        for (key, want) in [
            ("pinned_bytes", real.pinned_bytes),
            ("trunk_read_bytes_per_token", real.trunk_read_bytes_per_token),
            ("expert_slots", real.expert_slots as u64),
        ] {
            assert_eq!(row[key].as_u64().unwrap(), want, "{key} at {budget}: {row}");
        }
        assert_eq!(row["drafting"].as_bool().unwrap(), real.draft_journals > 0, "{row}");
        // The time columns are the bytes read at each rate.
        let read = row["read_bytes_per_token"].as_u64().unwrap();
        let secs: Vec<f64> =
            row["read_seconds_per_token"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap()).collect();
        for (s, rate) in secs.iter().zip([3.0, 7.0, 14.0, 28.0]) {
            assert!((s - read as f64 / (rate * 1e9)).abs() < 1e-12, "{s} at {rate}");
        }
    }
    // With a slot for every expert (1 GB), a token reads nothing; at 4 MB the pool holds few
    // and a token reads its experts of every MoE layer but the share the pool holds.
    let (tight, all_held) = (&rows[0], &rows[1]);
    assert_eq!(all_held["expert_hit_share"].as_f64().unwrap(), 1.0, "{all_held}");
    assert_eq!(all_held["read_bytes_per_token"].as_u64().unwrap(), 0, "{all_held}");
    let cfg = k3ring::config::Config::from_model_dir(&tiny_dir()).unwrap();
    let moe = cfg.layers.iter().filter(|l| l.ffn == k3ring::config::FfnKind::Moe).count() as f64;
    let every = moe * cfg.moe.top_k as f64 * roomy.expert_slot_bytes as f64;
    let hit = tight["expert_hit_share"].as_f64().unwrap();
    assert!(hit < 0.5, "{tight}");
    assert!((tight["expert_read_bytes_per_token"].as_f64().unwrap() - every * (1.0 - hit)).abs() <= 1.0, "{tight}");
    // The smallest budget that pins the whole trunk does, and 1 MB less does not.
    let resident = t["trunk_resident_bytes"].as_u64().unwrap();
    assert!(plan(resident).streamed.is_empty());
    assert!(!plan(resident - 1_000_000).streamed.is_empty());
}

#[test]
fn the_release_config_gives_a_table_from_the_minimum_to_the_resident_trunk() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/k3-config.json");
    let t = table(&["--config", config]);
    // The release: 82,432 experts of 17.5 MB, a trunk of about 109 GB without the embedding.
    assert_eq!(t["experts"].as_u64().unwrap(), 82_432);
    let trunk = t["trunk_bytes"].as_f64().unwrap() / 1e9;
    assert!((100.0..120.0).contains(&trunk), "{trunk} GB");
    let rows = t["rows"].as_array().unwrap();
    let budgets: Vec<u64> = rows.iter().map(|r| r["budget_bytes"].as_u64().unwrap()).collect();
    assert_eq!(budgets[0], t["minimum_bytes"].as_u64().unwrap());
    assert_eq!(*budgets.last().unwrap(), t["trunk_resident_bytes"].as_u64().unwrap());
    assert!(budgets.windows(2).all(|w| w[0] < w[1]), "{budgets:?}");
    // More memory never reads more.
    let reads: Vec<u64> = rows.iter().map(|r| r["read_bytes_per_token"].as_u64().unwrap()).collect();
    assert!(reads.windows(2).all(|w| w[0] >= w[1]), "{reads:?}");
    assert_eq!(rows.last().unwrap()["trunk_read_bytes_per_token"].as_u64().unwrap(), 0);
    // A batch shares each step's trunk and experts: fewer bytes per token.
    let batch = table(&["--config", config, "--max-batch", "8", "--context", "1024", "--budgets", "64"]);
    let (one, eight) =
        (&table(&["--config", config, "--context", "1024", "--budgets", "64"])["rows"][0], &batch["rows"][0]);
    assert_eq!(eight["sequences"].as_u64().unwrap(), 8);
    let per_token = |r: &Value, k: &str| r[k].as_u64().unwrap() as f64;
    assert!(per_token(eight, "trunk_read_bytes_per_token") * 7.0 < per_token(one, "trunk_read_bytes_per_token"));
    assert!(per_token(eight, "expert_read_bytes_per_token") < per_token(one, "expert_read_bytes_per_token"));
    // The text form names the columns and the assumption.
    let (code, text, err) = k3ring(&["plan", "--config", config, "--budgets", "32"]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("s/tok @7 GB/s") && text.contains("routing spread evenly"), "{text}");
    for (args, says) in [
        (&["--rates", "0"][..], "--rates"),
        (&["--budgets", "-1"][..], "--budgets"),
        (&["--context", "1"][..], "--context"),
    ] {
        let (code, _, err) = k3ring(&[&["plan", "--config", config][..], args].concat());
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // A config that cannot be read is an I/O error naming the file (exit 4).
    let (code, _, err) = k3ring(&["plan", "--config", "/nonexistent/config.json"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("/nonexistent/config.json"), "{err}");
}

/// README's sizing table is `plan`'s own output on the release's config, row for row: it cannot
/// drift from the planner.
#[test]
fn the_readme_sizing_table_is_plans_output() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/k3-config.json");
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme.split("## The real model").nth(1).expect("README has a real-model section");
    let rows: Vec<&str> =
        section.lines().skip_while(|l| !l.starts_with("| budget |")).take_while(|l| l.starts_with('|')).collect();
    assert!(rows.len() > 3, "no sizing table in README's real-model section");
    let (code, text, err) = k3ring(&["plan", "--config", config]);
    assert_eq!(code, 0, "{err}");
    let printed: Vec<&str> = text.lines().filter(|l| l.starts_with('|')).collect();
    assert_eq!(
        rows, printed,
        "README's table differs from `k3ring plan --config tests/fixtures/k3-config.json`:\n{text}"
    );
}
