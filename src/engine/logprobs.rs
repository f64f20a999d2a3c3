//! Log-probabilities of chosen tokens: a log-softmax over the whole vocabulary of the f32 logits
//! the sampler saw, and the likeliest alternatives. Reported, never used to choose: the tokens
//! are the same with or without them. The sum runs in f64 in vocabulary order, so a token's
//! log-probability is the same whatever else is in the batch or how many threads ran.
#![forbid(unsafe_code)]

use serde::Serialize;

/// Alternatives per token at most (`top_logprobs`, `--logprobs N`), as OpenAI allows.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A token and its log-probability.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct IdLogprob {
    pub id: u32,
    pub logprob: f32,
}

/// A chosen token's log-probability and the `top` likeliest tokens of the same distribution
/// (highest first; ties by lower id).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<IdLogprob>,
}

/// The log-softmax of `logits` at `id`, with the `top` likeliest tokens. NaN logits count as
/// impossible (log-probability `-inf`).
pub fn token_logprob(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    let at = |i: usize| {
        let lp = logits.get(i).map_or(f64::NAN, |&v| f64::from(v) - lse);
        if lp.is_nan() {
            f32::NEG_INFINITY
        } else {
            lp as f32
        }
    };
    let top = top_ids(logits, top).into_iter().map(|i| IdLogprob { id: i as u32, logprob: at(i) }).collect();
    TokenLogprob { id, logprob: at(id as usize), top }
}

/// `ln(sum(exp(x)))` over the non-NaN logits, in f64, in index order.
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if !max.is_finite() {
        return f64::from(max);
    }
    let m = f64::from(max);
    let sum: f64 = logits.iter().filter(|v| !v.is_nan()).map(|&v| (f64::from(v) - m).exp()).sum();
    m + sum.ln()
}

/// The indices of the `n` largest logits, highest first, ties by lower index; NaN never.
fn top_ids(logits: &[f32], n: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    // Strictly higher, or equal with a lower index: the total order the list is kept in.
    let before = |a: usize, b: usize| logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    for (i, v) in logits.iter().enumerate() {
        if v.is_nan() || (best.len() == n && !before(i, best[n - 1])) {
            continue;
        }
        let at = best.iter().position(|&b| before(i, b)).unwrap_or(best.len());
        best.insert(at, i);
        best.truncate(n);
    }
    best
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_sorted_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NAN, -1.0];
        let lp = token_logprob(&logits, 2, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0, -1.0].iter().map(|v| v.exp()).sum();
        assert!((f64::from(lp.logprob) - (2.0 - z.ln())).abs() < 1e-6, "{lp:?}");
        // Ties by lower id: 1 before 3.
        assert_eq!(lp.top.iter().map(|t| t.id).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert_eq!(lp.top[2].logprob, lp.logprob);
        assert_eq!(token_logprob(&logits, 4, 0).logprob, f32::NEG_INFINITY);
        assert!(token_logprob(&logits, 1, 0).top.is_empty());
        // The probabilities sum to 1.
        let total: f64 = (0..6).map(|i| f64::from(token_logprob(&logits, i, 0).logprob).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        // More alternatives than tokens: all the non-NaN ones.
        assert_eq!(token_logprob(&logits, 0, 20).top.len(), 5);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        // exp(1000) overflows even f64 unless the largest logit is taken out first.
        let logits = [1000.0f32, 1000.0, 0.0];
        let lp = token_logprob(&logits, 0, 1);
        assert!((lp.logprob - (-std::f32::consts::LN_2)).abs() < 1e-6, "{lp:?}");
        assert_eq!(token_logprob(&[f32::NEG_INFINITY; 3], 0, 1).logprob, f32::NEG_INFINITY);
    }
}
