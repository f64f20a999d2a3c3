#!/usr/bin/env bash
# Shows which syscalls read the weights, per backend: a streaming run of the tiny model under
# strace, counting io_uring_setup/io_uring_enter (the ring) against pread64 (the thread pool).
# With --io uring the weights arrive through io_uring_enter; the two pread64 calls left are the
# dynamic loader reading ELF headers of shared libraries, before main.
# Usage: benches/syscalls.sh   (needs strace)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/k3ring}
[ -x "$BIN" ] || cargo build --release
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$BIN" pack --model tests/fixtures/tiny-k3 --out "$WORK/trunk" > /dev/null
for io in uring pread; do
  strace -f -qq -c -e trace=io_uring_setup,io_uring_enter,io_uring_register,pread64 -o "$WORK/$io.txt" \
    "$BIN" run --model tests/fixtures/tiny-k3 --trunk "$WORK/trunk" --mem-gb 0.0015 --io "$io" \
    --prompt "Once upon a time" --gen 8 --ignore-eos > /dev/null 2>&1
  echo "== --io $io"
  echo "calls syscall"
  grep -E "io_uring|pread64" "$WORK/$io.txt" | grep -v total | awk '{print $4, $NF}'
done
