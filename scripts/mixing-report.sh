#!/usr/bin/env bash
# Replays every Alibaba "openb" trace that has a qos column with `tessera simulate --mixing`
# (seeds 42..51, policy demand-fgd) in each configuration below, and prints the table of
# docs/placement.md ("Mixing online and batch").
#
#   scripts/mixing-report.sh                        # everything
#   CONFIGS="plain mix" TRACES="default" scripts/mixing-report.sh
#   REPORT_ONLY=1 scripts/mixing-report.sh          # rebuild the table from saved runs
#
# DATA (default ../shared/data/alibaba-gpu-v2023 from the repository root) holds csv/. Runs are
# saved under target/mixing-report/ and reused unless FRESH=1. TESSERA names a binary to run
# instead of building one. Needs cargo and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/alibaba-gpu-v2023}
OUT=target/mixing-report
SEEDS=${SEEDS:-42..51}
POLICY=${POLICY:-demand-fgd}
# mix: --mixing, no over-commit; mem2/mem15: memory factor 2/1.5 (every GPU hami-core); cpu2:
# compute factor 2; plain: today's replay (to check that mixing alone changes no placement).
CONFIGS=${CONFIGS:-"mix mem2 cpu2 mem15 plain"}
ALL_TRACES=$(ls "$DATA"/csv/openb_pod_list_*.csv | sed 's/.*openb_pod_list_//; s/\.csv$//' | tr '\n' ' ')
TRACES=${TRACES:-$ALL_TRACES}
mkdir -p "$OUT"

flags() {
  case "$1" in
    plain) echo "" ;;
    mix) echo "--mixing" ;;
    cpu2) echo "--mixing --batch-overcommit 2" ;;
    mem15) echo "--mixing --batch-memory-overcommit 1.5" ;;
    mem2) echo "--mixing --batch-memory-overcommit 2" ;;
    *) echo "unknown config $1" >&2; exit 2 ;;
  esac
}

if [[ -z "${REPORT_ONLY:-}" ]]; then
  if [[ -z "${TESSERA:-}" ]]; then
    cargo build --release --locked -p tessera-controller --bin tessera
  fi
  BIN=${TESSERA:-target/release/tessera}
  for config in $CONFIGS; do
    for trace in $TRACES; do
      pods="$DATA/csv/openb_pod_list_$trace.csv"
      if ! head -1 "$pods" | tr ',' '\n' | grep -qx qos; then
        continue
      fi
      file="$OUT/$trace.$config.json"
      if [[ -s "$file" && -z "${FRESH:-}" ]]; then continue; fi
      echo "simulate $trace $config" >&2
      # shellcheck disable=SC2046
      "$BIN" simulate --nodes "$DATA/csv/openb_node_list_gpu_node.csv" \
        --pods "$pods" --policy "$POLICY" --seeds "$SEEDS" $(flags "$config") \
        -o json > "$file.tmp"
      mv "$file.tmp" "$file"
    done
  done
fi

python3 - "$OUT" $TRACES <<'PY'
import json, os, sys
out, traces = sys.argv[1], sys.argv[2:]
def load(trace, config):
    path = os.path.join(out, f"{trace}.{config}.json")
    return json.load(open(path)) if os.path.exists(path) else None
def cells(d, full):
    if d is None:
        return [""] * (6 if full else 4)
    m = d["mixing"]
    c = [f'{d["unallocated_pct_at_100"]:.2f}', f'{m["online_placed_pct_at_100"]:.2f}',
         f'{m["batch_placed_pct_at_100"]:.2f}']
    if full:
        c += [f'{m["placed_pct_of_capacity_at_100"]:.2f}', f'{m["batch_overcommitted_pct_at_100"]:.2f}']
    return c + [f'{m["online_preempt_pct_before_100"]:.2f} ({m["online_would_preempt"]:.0f})']
configs = [(c, n) for c, n in (("mem15", "memory x1.5"), ("mem2", "memory x2"))
           if any(load(t, c) for t in traces)]
head = ["trace", "unalloc %", "online placed %", "batch placed %", "would preempt % (n)"]
for _, name in configs:
    head += [f"{name}: unalloc %", "online placed %", "batch placed %", "placed % of capacity",
             "batch over-committed %", "would preempt % (n)"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for t in traces:
    mix = load(t, "mix")
    if mix is None:
        continue
    row = [t] + cells(mix, False)
    for c, _ in configs:
        row += cells(load(t, c), True)
    print("| " + " | ".join(row) + " |")
cpu = [t for t in traces if load(t, "cpu2") and load(t, "mix")]
same = [t for t in cpu if load(t, "cpu2")["allocation_curve"] == load(t, "mix")["allocation_curve"]]
if cpu:
    print(f"\ncompute factor 2 (--batch-overcommit 2): allocation curves identical to --mixing alone "
          f"on {len(same)} of {len(cpu)} traces ({', '.join(cpu)})")
plain = [t for t in traces if load(t, "plain") and load(t, "mix")]
same = [t for t in plain if load(t, "plain")["allocation_curve"] == load(t, "mix")["allocation_curve"]]
if plain:
    print(f"\n--mixing without over-commit: allocation curves identical to today's replay on "
          f"{len(same)} of {len(plain)} traces ({', '.join(plain)})")
PY
