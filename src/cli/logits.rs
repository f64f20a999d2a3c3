//! `run --logits FILE [--logits-top N]`: the logits of every prompt position and every generated
//! step, so that k3ring can be compared with another implementation without patching it. The
//! format is in `docs/LOGITS.md`: one JSON header line, then little-endian f32 rows (or, with
//! `--logits-top N`, N u32 ids then N f32 values per row).

use std::path::Path;

use serde::Serialize;

use crate::engine::{Fingerprint, Generation};

/// The `format` of the header; `version` changes with any change of the layout.
pub const FORMAT: &str = "k3ring-logits";
pub const VERSION: u32 = 1;

#[derive(Serialize)]
struct Header {
    format: &'static str,
    version: u32,
    /// Rows in the file: one per input position.
    rows: usize,
    vocab: usize,
    /// Values per row: `vocab`, or N with `--logits-top N`.
    cols: usize,
    /// "full" (`vocab` f32 per row) or "top" (N u32 ids, then N f32 logits, largest first).
    layout: &'static str,
    dtype: &'static str,
    byte_order: &'static str,
    /// Of the model (config and tensor list; see `engine::state_file::Fingerprint`), hex.
    fingerprint_config: String,
    fingerprint_checkpoint: String,
    /// Prompt rows come first (`prompt_rows` of them), then one row per generated token but
    /// the last (whose logits the run never computed).
    prompt_rows: usize,
    /// The input token of each row: row i holds the logits after `ids[i]`, which score the
    /// token at position i + 1.
    ids: Vec<u32>,
}

/// The rows of `g` in file order, with their input ids: the prompt rows, then the logits of the
/// generated steps after the first (the first equals the last prompt row).
fn rows(g: &Generation, vocab: usize) -> (Vec<&[f32]>, Vec<u32>, usize) {
    let prompt_rows: Vec<&[f32]> = g.prompt_logits.chunks_exact(vocab).collect();
    let n_prompt = prompt_rows.len();
    let mut ids: Vec<u32> = g.prompt_ids[..n_prompt].to_vec();
    let mut all = prompt_rows;
    for (k, row) in g.logits.iter().enumerate().skip(1) {
        all.push(row);
        ids.push(g.generated_ids[k - 1]);
    }
    (all, ids, n_prompt)
}

/// The indices of the `n` largest values of `row`, largest first (ties: lower id first).
fn top_n(row: &[f32], n: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    idx.truncate(n);
    idx
}

/// Writes the file (created earlier by the run, see `output`).
pub fn write(path: &Path, g: &Generation, vocab: usize, top: Option<usize>, fp: Fingerprint) -> anyhow::Result<()> {
    let (rows, ids, prompt_rows) = rows(g, vocab);
    let cols = top.map_or(vocab, |n| n.min(vocab));
    let header = Header {
        format: FORMAT,
        version: VERSION,
        rows: rows.len(),
        vocab,
        cols,
        layout: if top.is_some() { "top" } else { "full" },
        dtype: "f32",
        byte_order: "little",
        fingerprint_config: format!("{:016x}", fp.config),
        fingerprint_checkpoint: format!("{:016x}", fp.checkpoint),
        prompt_rows,
        ids,
    };
    let mut bytes = serde_json::to_vec(&header)?;
    bytes.push(b'\n');
    for row in rows {
        match top {
            None => row.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            Some(_) => {
                let best = top_n(row, cols);
                best.iter().for_each(|id| bytes.extend_from_slice(&id.to_le_bytes()));
                best.iter().for_each(|&id| bytes.extend_from_slice(&row[id as usize].to_le_bytes()));
            }
        }
    }
    Ok(super::output::create_now("--logits", path)?.write_all(&bytes)?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn logits_rows_are_the_prompt_then_every_step_but_the_first() {
        let g = Generation {
            prompt_ids: vec![5, 6],
            generated_ids: vec![7, 8, 9],
            prompt_logits: vec![0.0, 1.0, 2.0, 3.0],
            logits: vec![vec![2.0, 3.0], vec![4.0, 5.0], vec![6.0, 7.0]],
            ..Generation::default()
        };
        let (rows, ids, n) = rows(&g, 2);
        assert_eq!(n, 2);
        assert_eq!(ids, [5, 6, 7, 8]);
        assert_eq!(rows, [&[0.0, 1.0][..], &[2.0, 3.0], &[4.0, 5.0], &[6.0, 7.0]]);
        assert_eq!(top_n(&[1.0, 3.0, 3.0, 0.5], 3), [1, 2, 0]);
    }
}
