//! Which device each expert goes to: in proportion to the devices' rates, spread within every
//! layer, so that a layer's misses (any 16 of its experts) split across the devices as their
//! rates do and every device finishes its share at about the same time.

/// Device of each of `experts` (in the order given: by layer, then expert id), by smooth
/// weighted round-robin over `rates` (each > 0): after any prefix of the list, device i holds
/// within one expert of its share `rate_i / sum`. Deterministic; equal rates give round-robin.
pub fn assign(layers: &[usize], rates: &[f64]) -> Vec<usize> {
    let total: f64 = rates.iter().sum();
    let mut current = vec![0.0f64; rates.len()];
    let mut out = Vec::with_capacity(layers.iter().sum());
    for &count in layers {
        for _ in 0..count {
            for (c, r) in current.iter_mut().zip(rates) {
                *c += r;
            }
            // The largest credit, the lowest index on ties.
            let mut pick = 0;
            for (i, &c) in current.iter().enumerate() {
                if c > current[pick] {
                    pick = i;
                }
            }
            current[pick] -= total;
            out.push(pick);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::assign;

    #[test]
    fn equal_rates_go_round_robin_and_unequal_ones_in_proportion_within_each_layer() {
        assert_eq!(assign(&[5], &[1.0, 1.0]), [0, 1, 0, 1, 0]);
        let picks = assign(&[64, 64], &[1.0, 4.0]);
        for layer in picks.chunks(64) {
            let slow = layer.iter().filter(|&&d| d == 0).count();
            assert!((12..=14).contains(&slow), "{slow} of 64 on the 1/5 device");
        }
        let three = assign(&[30], &[3.0, 2.0, 1.0]);
        let counts: Vec<usize> = (0..3).map(|d| three.iter().filter(|&&x| x == d).count()).collect();
        assert_eq!(counts, [15, 10, 5]);
    }
}
