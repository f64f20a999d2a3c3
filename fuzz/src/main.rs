//! One afl.rs persistent-mode fuzzer for every target: `k3ring-fuzz TARGET` (targets in
//! `tests/fuzz_replay/targets.rs`, shared with the corpus replay test). The target's refusal must
//! carry its documented exit code; anything else, a panic, or an allocation above the cap
//! aborts, which AFL records as a crash.

#[path = "../../tests/fuzz_replay/targets.rs"]
mod targets;

use targets::CappedAlloc;

#[global_allocator]
static GLOBAL: CappedAlloc = CappedAlloc::new();

pub const TINY_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-k3");

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let Some(target) = targets::target(&name) else {
        let names: Vec<&str> = targets::TARGETS.iter().map(|t| t.name).collect();
        eprintln!("usage: k3ring-fuzz TARGET (one of {})", names.join(", "));
        std::process::exit(2);
    };
    afl::fuzz!(|data: &[u8]| {
        if let Err(code) = (target.run)(data) {
            assert_eq!(code, target.refusal, "{name}: refused with the wrong exit code");
        }
    });
}
