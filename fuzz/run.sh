#!/usr/bin/env bash
# Fuzzes one target until it has run EXECS inputs: fuzz/run.sh TARGET [EXECS] [OUT]
# Seeds from tests/fuzz_corpus/TARGET; findings in OUT (default /tmp/fuzz-TARGET).
# One process, one core; see docs/FUZZING.md. SKIP_BUILD=1 fuzzes the binary as last built.
set -euo pipefail
cd "$(dirname "$0")"
target=$1
execs=${2:-10000000}
out=${3:-/tmp/fuzz-$target}
export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_NO_AFFINITY=1
# One core per fuzzer: the checkpoint index parses shards on rayon threads.
export RAYON_NUM_THREADS=1
[ -n "${SKIP_BUILD:-}" ] || cargo afl build --release
exec cargo afl fuzz -i "../tests/fuzz_corpus/$target" -o "$out" -x "dict/$target.dict" \
    -t 2000 -E "$execs" -- target/release/k3ring-fuzz "$target"
