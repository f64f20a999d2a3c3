//! Helpers shared by the trace tests of several files: a synthetic clock and a Chrome JSON
//! round trip. Test builds only.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;

use super::Tracer;

/// Makes `t.now_us()` return `now_us` from now on (until set again).
pub(super) fn set_now(t: &Tracer, now_us: f64) {
    t.fake_now_bits.store(now_us.to_bits(), Ordering::Relaxed);
}

/// Writes `t`'s trace to a temporary file and parses it back.
pub(super) fn write_and_parse(t: &Tracer) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    t.write_chrome_json(&crate::files::Output::resolve("--trace", &path, false).unwrap()).unwrap();
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}
