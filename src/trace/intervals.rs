//! Interval algebra over microsecond times: the [`IntervalSet`] a shard merges busy spans into
//! as they are recorded, and the union, clip, measure and intersection the fold and the metrics
//! summary compute with. Pure functions on the caller's thread; they allocate only the vectors
//! they return or grow.

/// `(start_us, end_us)` with `start_us < end_us`.
pub(super) type Interval = (f64, f64);

/// Sorted, disjoint, non-touching intervals. Spans of one thread arrive almost in order, so an
/// insert is usually an append or an extension of the last interval.
#[derive(Debug, Default)]
pub(super) struct IntervalSet {
    pub(super) items: Vec<Interval>,
}

impl IntervalSet {
    pub(super) fn insert(&mut self, start: f64, end: f64) {
        debug_assert!(start < end);
        match self.items.last_mut() {
            Some(last) if start >= last.0 && start <= last.1 => last.1 = last.1.max(end),
            Some(last) if start < last.0 => self.insert_out_of_order(start, end),
            _ => self.items.push((start, end)),
        }
    }

    fn insert_out_of_order(&mut self, start: f64, end: f64) {
        // Intervals lo..hi touch or overlap [start, end]; they become one.
        let lo = self.items.partition_point(|iv| iv.1 < start);
        let hi = self.items.partition_point(|iv| iv.0 <= end);
        assert!(lo <= hi);
        if lo == hi {
            self.items.insert(lo, (start, end));
            return;
        }
        let merged = (start.min(self.items[lo].0), end.max(self.items[hi - 1].1));
        self.items[lo] = merged;
        self.items.drain(lo + 1..hi);
    }

    /// Moves the parts of all intervals before `horizon` into `out`.
    pub(super) fn drain_before(&mut self, horizon: f64, out: &mut Vec<Interval>) {
        let whole = self.items.partition_point(|iv| iv.1 <= horizon);
        out.extend(self.items.drain(..whole));
        if let Some(first) = self.items.first_mut() {
            if first.0 < horizon {
                out.push((first.0, horizon));
                first.0 = horizon;
            }
        }
    }
}

/// The union of `items` as sorted, disjoint intervals.
pub(super) fn union(mut items: Vec<Interval>) -> Vec<Interval> {
    items.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<Interval> = Vec::with_capacity(items.len());
    for (start, end) in items {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// `items` (sorted, disjoint) restricted to `[lo, hi]`.
pub(super) fn clip(items: Vec<Interval>, lo: f64, hi: f64) -> Vec<Interval> {
    items.into_iter().map(|(s, e)| (s.max(lo), e.min(hi))).filter(|(s, e)| s < e).collect()
}

/// Total length of sorted, disjoint intervals.
pub(super) fn measure(items: &[Interval]) -> f64 {
    items.iter().map(|(s, e)| e - s).sum()
}

/// Measure of the intersection of two sorted, disjoint lists.
pub(super) fn intersect_measure(a: &[Interval], b: &[Interval]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if lo < hi {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_interval_set_merges() {
        let mut set = IntervalSet::default();
        for (s, e) in [(10.0, 20.0), (30.0, 40.0), (0.0, 5.0), (20.0, 25.0), (50.0, 60.0), (4.0, 31.0)] {
            set.insert(s, e);
        }
        assert_eq!(set.items, vec![(0.0, 40.0), (50.0, 60.0)]);
        set.insert(45.0, 46.0);
        assert_eq!(set.items, vec![(0.0, 40.0), (45.0, 46.0), (50.0, 60.0)]);
        let mut out = Vec::new();
        set.drain_before(55.0, &mut out);
        assert_eq!(out, vec![(0.0, 40.0), (45.0, 46.0), (50.0, 55.0)]);
        assert_eq!(set.items, vec![(55.0, 60.0)]);
    }

    #[test]
    fn trace_intersect_measure_two_pointer() {
        let a = [(0.0, 10.0), (20.0, 30.0), (40.0, 50.0)];
        let b = [(5.0, 25.0), (28.0, 45.0)];
        // [5,10] + [20,25] + [28,30] + [40,45]
        assert_eq!(intersect_measure(&a, &b), 17.0);
        assert_eq!(intersect_measure(&a, &[]), 0.0);
    }
}
