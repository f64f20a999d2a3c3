//! The config's sizes against the checkpoint's headers, checked before the list of expected
//! tensors is built: that list grows with layers x experts, so a config claiming more of either
//! than the checkpoint holds is refused here, in a few hundred lookups, naming the key, its value
//! and what the headers say (exit 3).

use super::{CheckpointError, CheckpointIndex, MODEL_PREFIX};
use crate::config::Config;

impl CheckpointIndex {
    /// Vocabulary and hidden width against the embedding, the layer count against the layers
    /// present, and the expert count against each MoE layer's router.
    pub(super) fn check_config_sizes(&self, cfg: &Config) -> Result<(), CheckpointError> {
        self.check_embedding(cfg)?;
        self.check_layer_count(cfg)?;
        self.check_expert_count(cfg)
    }

    fn check_embedding(&self, cfg: &Config) -> Result<(), CheckpointError> {
        let name = format!("{MODEL_PREFIX}embed_tokens.weight");
        // A missing or oddly shaped embedding is reported by the tensor-by-tensor check.
        let Some(&[rows, cols]) = self.get(&name).map(|t| &t.shape[..]) else { return Ok(()) };
        for (key, value, have, what) in
            [("vocab_size", cfg.vocab_size, rows, "rows"), ("hidden_size", cfg.hidden_size, cols, "columns")]
        {
            if value as u64 != have {
                return Err(mismatch(&name, key, value, format!("the embedding has {have} {what}")));
            }
        }
        Ok(())
    }

    fn check_layer_count(&self, cfg: &Config) -> Result<(), CheckpointError> {
        let norm = |l: usize| format!("{MODEL_PREFIX}layers.{l}.input_layernorm.weight");
        // Probe upwards: at most num_hidden_layers lookups, itself bounded by the config check.
        let Some(first_missing) = (0..cfg.n_layers).find(|&l| self.get(&norm(l)).is_none()) else { return Ok(()) };
        Err(mismatch(
            &norm(first_missing),
            "num_hidden_layers",
            cfg.n_layers,
            format!("the checkpoint's layers stop at {first_missing} (this tensor is missing)"),
        ))
    }

    fn check_expert_count(&self, cfg: &Config) -> Result<(), CheckpointError> {
        for l in cfg.moe_layers() {
            let name = format!("{MODEL_PREFIX}layers.{l}.block_sparse_moe.gate.weight");
            let Some(rows) = self.get(&name).and_then(|t| t.shape.first().copied()) else { continue };
            if rows != cfg.moe.n_experts as u64 {
                return Err(mismatch(&name, "num_experts", cfg.moe.n_experts, format!("the router has {rows} rows")));
            }
        }
        Ok(())
    }
}

fn mismatch(tensor: &str, key: &str, value: usize, found: String) -> CheckpointError {
    CheckpointError::Schema {
        tensor: tensor.to_owned(),
        message: format!("config.json has {key} = {value} but {found}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::Path;

    use crate::checkpoint::{CheckpointError, CheckpointIndex};
    use crate::config::Config;
    use crate::exit::{Classify, ExitCode};

    fn tiny_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3")
    }

    /// The tiny config with `edit` applied to its text keys.
    fn tiny_config(edit: impl FnOnce(&mut serde_json::Value)) -> Config {
        let text = std::fs::read_to_string(tiny_dir().join("config.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let text_keys = if v.get("text_config").is_some() { &mut v["text_config"] } else { &mut v };
        edit(text_keys);
        Config::from_json_str(&v.to_string(), Path::new("config.json")).unwrap()
    }

    fn refusal(index: &CheckpointIndex, cfg: &Config) -> String {
        let err = index.validate(cfg).unwrap_err();
        assert!(matches!(err, CheckpointError::Schema { .. }), "{err}");
        assert_eq!(err.exit_code(), ExitCode::Data, "{err}");
        err.to_string()
    }

    #[test]
    fn counts_above_the_checkpoint_are_refused_naming_the_key() {
        let index = CheckpointIndex::open(&tiny_dir()).unwrap();
        let cfg = tiny_config(|t| t["num_experts"] = 65536.into());
        let err = refusal(&index, &cfg);
        assert!(err.contains("config.json has num_experts = 65536 but the router has 16 rows"), "{err}");
        assert!(err.contains("layers.1.block_sparse_moe.gate.weight"), "{err}");

        let cfg = tiny_config(|t| {
            t["num_hidden_layers"] = 4096.into();
            let kda: Vec<usize> = (14..=4096).collect();
            let mut listed = t["linear_attn_config"]["kda_layers"].as_array().unwrap().clone();
            listed.extend(kda.into_iter().map(serde_json::Value::from));
            t["linear_attn_config"]["kda_layers"] = listed.into();
        });
        let err = refusal(&index, &cfg);
        assert!(
            err.contains("config.json has num_hidden_layers = 4096 but the checkpoint's layers stop at 13"),
            "{err}"
        );

        let cfg = tiny_config(|t| t["vocab_size"] = 1_000_000.into());
        let err = refusal(&index, &cfg);
        assert!(err.contains("config.json has vocab_size = 1000000 but the embedding has 768 rows"), "{err}");
    }
}
