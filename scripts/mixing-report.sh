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
# saved under target/mixing-report/ and reused unless FRESH=1. Needs cargo and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/alibaba-gpu-v2023}
OUT=target/mixing-report
SEEDS=${SEEDS:-42..51}
POLICY=${POLICY:-demand-fgd}
# plain: today's replay; mix: --mixing, no over-commit; cpu2: compute factor 2; mem15/mem2:
# memory factor 1.5/2 (every GPU hami-core).
CONFIGS=${CONFIGS:-"plain mix cpu2 mem15 mem2"}
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
  cargo build --release --locked -p tessera-controller --bin tessera
  for trace in $TRACES; do
    pods="$DATA/csv/openb_pod_list_$trace.csv"
    if ! head -1 "$pods" | tr ',' '\n' | grep -qx qos; then
      echo "skip $trace: no qos column" >&2
      continue
    fi
    for config in $CONFIGS; do
      file="$OUT/$trace.$config.json"
      if [[ -s "$file" && -z "${FRESH:-}" ]]; then continue; fi
      echo "simulate $trace $config" >&2
      # shellcheck disable=SC2046
      target/release/tessera simulate --nodes "$DATA/csv/openb_node_list_gpu_node.csv" \
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
print("| trace | today: unalloc % | mixing | online placed % | batch placed % | would preempt (% of online GPU tasks) | "
      "mem x1.5: online placed % | batch placed % | placed % of capacity | batch over-committed % | would preempt | "
      "mem x2: online placed % | batch placed % | placed % of capacity | batch over-committed % | would preempt |")
print("|" + "---|" * 16)
for t in traces:
    plain, mix, m15, m2 = (load(t, c) for c in ("plain", "mix", "mem15", "mem2"))
    if mix is None:
        continue
    def cells(d, full):
        if d is None:
            return [""] * (5 if full else 3)
        m = d["mixing"]
        base = [f'{m["online_placed_pct_at_100"]:.2f}', f'{m["batch_placed_pct_at_100"]:.2f}']
        if full:
            base += [f'{m["placed_pct_of_capacity_at_100"]:.2f}', f'{m["batch_overcommitted_pct_at_100"]:.2f}']
        return base + [f'{m["online_preempt_pct_before_100"]:.2f} ({m["online_would_preempt"]:.0f})']
    row = [t, f'{plain["unallocated_pct_at_100"]:.2f}' if plain else "",
           f'{100 - mix["unallocated_pct_at_100"]:.2f} placed'] + cells(mix, False) + cells(m15, True) + cells(m2, True)
    print("| " + " | ".join(row) + " |")
cpu = [t for t in traces if load(t, "cpu2") and load(t, "mix")]
same = [t for t in cpu if load(t, "cpu2")["allocation_curve"] == load(t, "mix")["allocation_curve"]]
if cpu:
    print(f"\ncompute factor 2: allocation curves identical to mixing without over-commit on {len(same)} of {len(cpu)} traces")
PY
