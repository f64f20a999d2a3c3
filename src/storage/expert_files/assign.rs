//! How each expert is striped over the devices: every expert's image is cut into one piece per
//! device, sized in proportion to the devices' rates, so that any set of misses (whatever the
//! routing picks) splits across the drives as their rates do and every drive finishes its share
//! of a layer's reads at about the same time. Whole experts per device would not: with 16
//! random misses over two drives, the busier one gets 9.6 on average, not 8.

/// Alignment units each device gets of each expert: `units[i]` is expert i's image length in
/// alignment units, `rates` one positive rate per device. Every expert's counts sum to its
/// units, and after any prefix of the experts each device holds its share `rate / sum` of the
/// units so far within one unit (largest remainders, carried over from expert to expert).
/// Deterministic: the lowest device index wins ties.
pub fn stripe(units: &[u64], rates: &[f64]) -> Vec<Vec<u64>> {
    let n = rates.len();
    let sum: f64 = rates.iter().sum();
    let share: Vec<f64> = rates.iter().map(|r| r / sum).collect();
    let mut held = vec![0u64; n];
    let mut total = 0u64;
    let mut out = Vec::with_capacity(units.len());
    for &u in units {
        total += u;
        // What each device lacks of its share of everything so far, scaled to this expert.
        let lack: Vec<f64> = (0..n).map(|d| (total as f64 * share[d] - held[d] as f64).max(0.0)).collect();
        let lacking: f64 = lack.iter().sum();
        let want: Vec<f64> =
            if lacking > 0.0 { lack.iter().map(|l| l * u as f64 / lacking).collect() } else { vec![0.0; n] };
        let mut counts: Vec<u64> = want.iter().map(|w| w.floor() as u64).collect();
        let mut left = u.saturating_sub(counts.iter().sum());
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| (want[b] - counts[b] as f64).total_cmp(&(want[a] - counts[a] as f64)).then(a.cmp(&b)));
        for &d in order.iter().cycle().take(n * 2) {
            if left == 0 {
                break;
            }
            counts[d] += 1;
            left -= 1;
        }
        // Rounding can only leave less than one unit per device; whatever remains goes to the
        // device that lacks the most.
        counts[order[0]] += left;
        for (h, c) in held.iter_mut().zip(&counts) {
            *h += c;
        }
        out.push(counts);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::stripe;

    #[test]
    fn each_expert_is_cut_in_proportion_to_the_rates_within_one_unit_overall() {
        assert_eq!(stripe(&[4, 3, 3], &[1.0, 1.0]), [vec![2, 2], vec![2, 1], vec![1, 2]]);
        let cuts = stripe(&[4272; 100], &[1.0, 4.0]);
        for c in &cuts {
            assert_eq!(c.iter().sum::<u64>(), 4272);
            assert!((854..=855).contains(&c[0]), "{c:?}");
        }
        // Experts of two units over three devices 3:2:1: the shares hold over the whole set.
        let small = stripe(&[2; 30], &[3.0, 2.0, 1.0]);
        let held: Vec<u64> = (0..3).map(|d| small.iter().map(|c| c[d]).sum()).collect();
        assert_eq!(held, [30, 20, 10]);
        assert!(small.iter().all(|c| c.iter().sum::<u64>() == 2));
    }
}
