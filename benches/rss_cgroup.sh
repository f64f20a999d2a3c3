#!/usr/bin/env bash
# Runs k3ring streaming inside a cgroup memory limit at several budgets and shows, per budget,
# the plan, the peak RSS (the process's VmHWM and the cgroup's own peak) and whether the
# generated ids are identical. The limit is the budget plus a fixed allowance for the binary,
# its libraries and the allocator (ALLOWANCE_MB), so a run that overshoots its plan is killed.
#
# Needs root (cgroup v1 memory controller or cgroup v2). Usage:
#   benches/rss_cgroup.sh [budgets GB ...]        default: 0.35 0.5 0.8 1.5
# Environment: MODEL, TRUNK (default: a `small` synthetic model under /var/tmp/k3ring-rss),
#   ALLOWANCE_MB (default 160), GEN (default 8).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/k3ring}
WORK=${WORK:-/var/tmp/k3ring-rss}
MODEL=${MODEL:-$WORK/model}
TRUNK=${TRUNK:-$WORK/trunk}
ALLOWANCE_MB=${ALLOWANCE_MB:-160}
GEN=${GEN:-8}
BUDGETS=("$@")
[ ${#BUDGETS[@]} -gt 0 ] || BUDGETS=(0.35 0.5 0.8 1.5)

[ -x "$BIN" ] || cargo build --release
mkdir -p "$WORK"
[ -f "$MODEL/config.json" ] || "$BIN" synth --dims small --layers 8 --experts 64 --out "$MODEL" >&2
"$BIN" pack --model "$MODEL" --out "$TRUNK" >&2

if [ -d /sys/fs/cgroup/memory ]; then
  CG_VERSION=1
  CG=/sys/fs/cgroup/memory/k3ring-rss
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  CG_VERSION=2
  CG=/sys/fs/cgroup/k3ring-rss
  echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
else
  echo "no cgroup memory controller found" >&2
  exit 1
fi

echo "| budget | cgroup limit | planned | peak RSS (VmHWM) | cgroup peak | s/token | ids |"
echo "|---|---|---|---|---|---|---|"
first_ids=""
status=0
for budget in "${BUDGETS[@]}"; do
  limit=$(python3 -c "print(int($budget * 1e9 + $ALLOWANCE_MB * 2**20))")
  rmdir "$CG" 2>/dev/null || true
  mkdir -p "$CG"
  if [ "$CG_VERSION" = 1 ]; then
    echo "$limit" > "$CG/memory.limit_in_bytes"
    echo 0 > "$CG/memory.max_usage_in_bytes" 2>/dev/null || true
  else
    echo "$limit" > "$CG/memory.max"
  fi
  out="$WORK/run-$budget.json"
  rm -f "$out"
  set +e
  sh -c "echo \$\$ > $CG/cgroup.procs && exec $BIN run --model $MODEL --trunk $TRUNK --mem-gb $budget \
      --prompt 'The quick brown fox' --gen $GEN --ignore-eos --json $out" > /dev/null 2> "$WORK/run-$budget.log"
  code=$?
  set -e
  if [ "$CG_VERSION" = 1 ]; then
    cg_peak=$(cat "$CG/memory.max_usage_in_bytes")
  else
    cg_peak=$(cat "$CG/memory.peak" 2>/dev/null || echo 0)
  fi
  if [ $code -ne 0 ] || [ ! -f "$out" ]; then
    echo "| $budget GB | $((limit >> 20)) MiB | - | - | $((cg_peak >> 20)) MiB | - | FAILED (exit $code, see $WORK/run-$budget.log) |"
    status=1
    continue
  fi
  read -r planned peak spt ids < <(python3 - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["plan"]["planned_bytes"], r["peak_rss_bytes"], round(r["seconds_per_token"], 3), ",".join(map(str, r["generated_ids"])))
PY
)
  [ -n "$first_ids" ] || first_ids=$ids
  same=$([ "$ids" = "$first_ids" ] && echo identical || echo DIFFERENT)
  [ "$same" = identical ] || status=1
  echo "| $budget GB | $((limit >> 20)) MiB | $((planned >> 20)) MiB | $((peak >> 20)) MiB | $((cg_peak >> 20)) MiB | $spt | $same |"
done
rmdir "$CG" 2>/dev/null || true
exit $status
