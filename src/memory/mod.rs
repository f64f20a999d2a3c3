//! How much more memory this process may use: `MemAvailable` from /proc/meminfo, capped by the
//! headroom of every memory cgroup the process is in (cgroup v2 `memory.max`, v1
//! `memory.limit_in_bytes`), so a run inside a container plans for the container and not for the
//! host. Every budget preset and every memory check reads it through [`available`], and says
//! which limit applied ([`Available::limited_by`]).
//!
//! A leaf: it depends on nothing else in the crate. The parsers take text and paths, so the tests
//! build fake /proc and cgroup trees.
#![forbid(unsafe_code)]

pub mod cgroup;

use std::fmt;

use serde::Serialize;

pub use cgroup::CgroupLimit;

/// Memory this process may still use, and what bounds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Available {
    pub bytes: u64,
    pub limited_by: Limit,
}

/// The limit that decided [`Available::bytes`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Limit {
    /// The system's `MemAvailable` (no cgroup limit is tighter).
    MemAvailable,
    /// A memory cgroup's limit minus its usage.
    Cgroup(CgroupLimit),
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::MemAvailable => write!(f, "MemAvailable in /proc/meminfo"),
            Limit::Cgroup(c) => write!(
                f,
                "the cgroup v{} limit {} = {} with {} in use",
                c.version,
                c.limit_file.display(),
                mib(c.limit),
                mib(c.usage)
            ),
        }
    }
}

impl fmt::Display for Available {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3} GB available (limited by {})", self.bytes as f64 / 1e9, self.limited_by)
    }
}

/// GB, like the budget the limit is compared with (not MiB next to GB).
fn mib(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

/// What this process may still allocate: the smaller of `MemAvailable` and the headroom of its
/// memory cgroups. Reads /proc and the cgroup files once; call it once per decision so a preset
/// and the check of that preset see the same number. `None` when neither can be read.
pub fn available() -> Option<Available> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let limits = cgroup::own_limits();
    combine(meminfo.as_deref().and_then(parse_mem_available), &limits)
}

/// How often [`available_for`] reads again, at most how many times in all (3 s), and after how
/// many readings in a row without growth it gives up (1 s: a budget beyond the machine).
const SETTLE_POLL: std::time::Duration = std::time::Duration::from_millis(100);
const SETTLE_POLLS_MAX: u32 = 30;
const SETTLE_POLLS_IDLE: u32 = 10;
/// Growth that counts as memory being returned.
const SETTLE_RISE_MIN: u64 = 64 << 20;

/// [`available`], read again while it is below `need` and rising: a run that just ended (a bench
/// cell, or a process that exited) has its pinned buffers released by the kernel after it is
/// gone, so for a moment `MemAvailable` still counts them (measured: 13.1 GB right after an
/// 11 GB run exited, 23.8 GB half a second later). Gives up after a second without growth and
/// after three in all, returning the last reading (the last good one if a reading fails).
pub fn available_for(need: u64) -> Option<Available> {
    settle(need, available, || std::thread::sleep(SETTLE_POLL))
}

fn settle(need: u64, mut read: impl FnMut() -> Option<Available>, mut pause: impl FnMut()) -> Option<Available> {
    let mut last = read()?;
    let (mut grown_to, mut idle) = (last.bytes, 0);
    for _ in 0..SETTLE_POLLS_MAX {
        if last.bytes >= need || idle >= SETTLE_POLLS_IDLE {
            break;
        }
        pause();
        match read() {
            Some(a) => last = a,
            None => break,
        }
        if last.bytes >= grown_to.saturating_add(SETTLE_RISE_MIN) {
            (grown_to, idle) = (last.bytes, 0);
        } else {
            idle += 1;
        }
    }
    Some(last)
}

/// The memory a budget needs available to pass the plan's check (`budget` at most
/// `PRESET_MAX_PERCENT`% of it), rounded up.
pub fn need_for_budget(budget: u64) -> u64 {
    let percent = crate::storage::plan::PRESET_MAX_PERCENT;
    budget.div_ceil(percent).saturating_mul(100)
}

/// The smaller of `mem_available` and the cgroups' headroom.
pub fn combine(mem_available: Option<u64>, cgroups: &[CgroupLimit]) -> Option<Available> {
    let tightest = cgroups.iter().min_by_key(|c| c.headroom());
    match (mem_available, tightest) {
        (Some(m), Some(c)) if c.headroom() < m => {
            Some(Available { bytes: c.headroom(), limited_by: Limit::Cgroup(c.clone()) })
        }
        (Some(m), _) => Some(Available { bytes: m, limited_by: Limit::MemAvailable }),
        (None, Some(c)) => Some(Available { bytes: c.headroom(), limited_by: Limit::Cgroup(c.clone()) }),
        (None, None) => None,
    }
}

/// `MemAvailable` of /proc/meminfo text, in bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    kib_field(meminfo, "MemAvailable:")
}

/// A `Key:   123 kB` line of /proc/meminfo or /proc/self/status, in bytes.
pub fn kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn cg(limit: u64, usage: u64) -> CgroupLimit {
        CgroupLimit { version: 1, limit_file: PathBuf::from("/cg/memory.limit_in_bytes"), limit, usage }
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   23841320 kB\n";
        assert_eq!(parse_mem_available(text), Some(23_841_320 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn the_tighter_of_meminfo_and_cgroup_wins_and_is_named() {
        let gib = 1u64 << 30;
        let a = combine(Some(16 * gib), &[cg(700 << 20, 100 << 20)]).unwrap();
        assert_eq!(a.bytes, 600 << 20);
        assert!(matches!(a.limited_by, Limit::Cgroup(_)));
        let text = a.to_string();
        assert!(
            text.contains("0.629 GB available")
                && text.contains("cgroup v1 limit /cg/memory.limit_in_bytes = 0.734 GB with 0.105 GB in use"),
            "{text}"
        );
        let a = combine(Some(gib), &[cg(8 * gib, gib)]).unwrap();
        assert_eq!((a.bytes, a.limited_by), (gib, Limit::MemAvailable));
        let a = combine(Some(16 * gib), &[cg(8 * gib, 0), cg(2 * gib, gib)]).unwrap();
        assert_eq!(a.bytes, gib, "the tightest of several cgroups");
        assert_eq!(combine(None, &[cg(gib, 2 * gib)]).unwrap().bytes, 0, "usage above the limit leaves nothing");
        assert_eq!(combine(None, &[]), None);
    }

    #[test]
    fn a_reading_below_the_need_is_taken_again_while_memory_is_returned() {
        let gb = |n: u64| Some(super::Available { bytes: n << 30, limited_by: super::Limit::MemAvailable });
        // Freed over three readings: the wait ends at the first that suffices.
        let mut seq = [12, 12, 18, 23, 23].into_iter();
        let mut pauses = 0;
        let got = super::settle(20 << 30, || gb(seq.next().unwrap_or(23)), || pauses += 1).unwrap();
        assert_eq!((got.bytes >> 30, pauses), (23, 3));
        // Enough at once: no wait.
        let mut pauses = 0;
        assert_eq!(super::settle(20 << 30, || gb(23), || pauses += 1).unwrap().bytes >> 30, 23);
        assert_eq!(pauses, 0);
        // Never enough and never rising: gives up after the idle readings, with the last one.
        let mut pauses = 0;
        assert_eq!(super::settle(100 << 30, || gb(12), || pauses += 1).unwrap().bytes >> 30, 12);
        assert_eq!(pauses, super::SETTLE_POLLS_IDLE);
        // Rising but never enough: bounded.
        let mut n = 0u64;
        let mut pauses = 0;
        let rising = || {
            n += 1;
            gb(n)
        };
        assert!(super::settle(1 << 50, rising, || pauses += 1).unwrap().bytes < 1 << 50);
        assert_eq!(pauses, super::SETTLE_POLLS_MAX);
        // A reading that fails mid-way keeps the last good one.
        let mut seq = [Some(12), Some(14), None].into_iter();
        let got = super::settle(20 << 30, || seq.next().flatten().and_then(gb), || {}).unwrap();
        assert_eq!(got.bytes >> 30, 14);
        // The need passes the plan's check: the budget is at most 95% of it.
        for budget in [1, 95, 96, 12_000_000_000, 12_000_000_001] {
            let need = super::need_for_budget(budget);
            assert!(budget <= need / 100 * crate::storage::plan::PRESET_MAX_PERCENT, "{budget}");
        }
    }
}
