//! The twin tests (`tests/twins/`) on an AVX-512 CPU when this host has none.
//!
//! The development and CI machines are AVX2-only and QEMU cannot emulate AVX-512, so this test
//! builds the twins statically and runs them inside Bochs on an emulated Skylake-X
//! (`tools/avx512-bochs/run.sh`), then checks that they passed and that AVX-512 was among the
//! ISAs they compared with scalar. About 4 minutes on 2 cores, most of it emulation.
//!
//! - On a host with AVX-512 it does nothing: the twins already run natively there.
//! - If the emulator cannot be set up (not root, no Debian packages: harness exit 125), it
//!   prints `SKIPPED` and passes, unless `K3_REQUIRE_AVX512_EMULATION=1`, which makes that a
//!   failure. A wrong bit on the AVX-512 path always fails.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kernels::Isa;

/// The line `with_isa_matches_availability` prints, which proves AVX-512 was compared.
const COVERAGE: &str = "twins cover ISAs: scalar, avx2, avx512";

/// Exit status of the harness when it could not set up the emulator.
const HARNESS_FAILURE: i32 = 125;

#[test]
fn twins_pass_on_emulated_avx512() {
    if Isa::Avx512.is_available() {
        eprintln!("avx512_emulated: this host has AVX-512; the twins cover it natively");
        return;
    }
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        say_uncaptured("SKIPPED avx512_emulated: needs an x86-64 Linux host");
        return;
    }
    let required = std::env::var_os("K3_REQUIRE_AVX512_EMULATION").is_some_and(|v| v == "1");
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let twins = build_static_twins(&workspace);
    let harness = workspace.join("tools/avx512-bochs/run.sh");
    let out = Command::new(&harness)
        .arg(&twins)
        .args(["--test-threads=1", "--nocapture"])
        .env("AVX512_BOCHS_TIMEOUT", "1800")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", harness.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code().unwrap_or(-1);
    if code == HARNESS_FAILURE && !required {
        say_uncaptured(&format!("SKIPPED avx512_emulated: the Bochs harness could not run here:\n{stderr}"));
        return;
    }
    assert_eq!(code, 0, "twins failed on emulated AVX-512 (exit {code}):\n{stdout}\n{stderr}");
    assert!(stdout.contains(COVERAGE), "the emulated run did not compare AVX-512 with scalar:\n{stdout}\n{stderr}");
    assert!(stdout.contains("test result: ok."), "no passing libtest summary:\n{stdout}");
    let timing = stderr.lines().filter(|l| l.contains("boot ")).collect::<Vec<_>>().join("; ");
    eprintln!("avx512_emulated: twins passed on an emulated AVX-512 CPU ({timing})");
}

/// Writes `message` to the process's standard error directly: libtest captures `eprintln!` of a
/// passing test, and a skip must show in the suite's output (and CI's log) to be noticed.
fn say_uncaptured(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{message}");
}

/// Builds `tests/twins/` as a static executable in its own target directory (so it does not
/// contend with the outer build's lock) and returns its path.
fn build_static_twins(workspace: &Path) -> PathBuf {
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("avx512-static");
    let out = Command::new(env!("CARGO"))
        .current_dir(workspace)
        .args(["test", "--release", "--locked", "-p", "k3ring-kernels", "--test", "twins", "--no-run"])
        .args(["--target", "x86_64-unknown-linux-gnu", "--message-format=json"])
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env("CARGO_TARGET_DIR", &target_dir)
        .output()
        .expect("cannot run cargo");
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "static build of the twins failed:\n{}", String::from_utf8_lossy(&out.stderr));
    executable_of(&json, "twins").unwrap_or_else(|| panic!("no twins executable in cargo's output:\n{json}"))
}

/// The `"executable"` of the compiler-artifact message for target `name`, read without a JSON
/// parser: cargo writes one message per line and escapes nothing in a plain Unix path.
fn executable_of(messages: &str, name: &str) -> Option<PathBuf> {
    let target = format!("\"name\":\"{name}\"");
    messages.lines().filter(|l| l.contains("compiler-artifact") && l.contains(&target)).find_map(|l| {
        let rest = &l[l.find("\"executable\":\"")? + "\"executable\":\"".len()..];
        Some(PathBuf::from(&rest[..rest.find('"')?]))
    })
}

#[test]
fn executable_is_read_from_cargo_messages() {
    let msgs = concat!(
        "{\"reason\":\"compiler-artifact\",\"target\":{\"name\":\"rayon\"},\"executable\":null}\n",
        "{\"reason\":\"compiler-artifact\",\"target\":{\"kind\":[\"test\"],\"name\":\"twins\"},",
        "\"executable\":\"/t/release/deps/twins-0a1b\",\"fresh\":true}\n",
    );
    assert_eq!(executable_of(msgs, "twins"), Some(PathBuf::from("/t/release/deps/twins-0a1b")));
    assert_eq!(executable_of(msgs, "accuracy"), None);
}
