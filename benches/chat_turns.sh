#!/usr/bin/env bash
# Measures what keeping the session state between chat turns saves on a streamed model: the
# same conversation twice, once as `k3ring chat` runs it (each turn prefills only its new
# tokens) and once with the whole transcript prefilled again before turn 2 (a `/system` line
# with the same text drops the state, so the next turn re-reads everything, as an engine
# without state reuse would). Prints `/stats` of each turn: tokens prefilled, prefill seconds,
# bytes read, expert hit rate. Greedy, so both runs see the same replies and the same turn 2.
#
# Usage: benches/chat_turns.sh    Environment: MODEL, TRUNK (a K3-width synth model and its
#   trunk pack, e.g. `k3ring synth --layers 4 --experts 256` + `k3ring pack`), MEM_GB (default
#   9: the trunk pinned, experts streamed), MAX_TOKENS (default 12), BIN.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/k3ring}
MODEL=${MODEL:?set MODEL to a model directory}
TRUNK=${TRUNK:?set TRUNK to its trunk pack}
MEM_GB=${MEM_GB:-9}
MAX_TOKENS=${MAX_TOKENS:-12}
SYSTEM="You are a helpful assistant."
TURN1="Tell me about the ring of storage that streams weights through memory."
TURN2="Now say it again more briefly, in one short sentence please."

[ -x "$BIN" ] || cargo build --release
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%s\n/stats\n%s\n/stats\n' "$TURN1" "$TURN2" >"$work/kept"
printf '%s\n/stats\n/system %s\n%s\n/stats\n' "$TURN1" "$SYSTEM" "$TURN2" >"$work/again"

for run in kept again; do
  "$BIN" chat --model "$MODEL" --trunk "$TRUNK" --mem-gb "$MEM_GB" --max-tokens "$MAX_TOKENS" \
    --system "$SYSTEM" <"$work/$run" >"$work/$run.out" 2>"$work/$run.err"
  echo "== state $run between turns"
  grep -E "plan:|last turn:" "$work/$run.err" | sed 's/^k3ring: //'
done
if cmp -s "$work/kept.out" "$work/again.out"; then
  echo "replies identical"
else
  echo "replies DIFFER"
  exit 1
fi
