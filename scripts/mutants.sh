#!/usr/bin/env bash
# Mutation test of the node's safety rules: cargo-mutants (27.1) mutates each file below that
# decides isolation, preparation or accounting, and runs the driver's library tests against
# every mutant. A mutant that leaves every test green is a rule no test guards.
#
#   scripts/mutants.sh                  # every file below, 2 jobs
#   FILES="driver/src/node/accounting.rs" scripts/mutants.sh
#   JOBS=4 scripts/mutants.sh
#   MUTANTS_FLAGS="--in-place --baseline=skip --timeout 120" JOBS= scripts/mutants.sh
#                                       # reuse this tree's warm target/ (no copy, no cold
#                                       # build); leave the tree alone until it ends
#
# Run it after changing a safety rule (docs/architecture.md). Not in CI: it takes about as long
# as a few hundred driver test runs. It exits 1 when a missed mutant is not listed as harmless
# below, and prints those; the full results are under target/mutants/mutants.out/.
set -euo pipefail
cd "$(dirname "$0")/.."

# The files that decide isolation, preparation and accounting.
DEFAULT_FILES="
driver/src/node/prepare.rs
driver/src/node/prepare/card.rs
driver/src/node/inventory/mig_minors.rs
driver/src/node/accounting.rs
driver/src/node/isolation.rs
driver/src/node/checkpoint/holdings.rs
driver/src/rules/config.rs
driver/src/rules/tier.rs
driver/src/rules/overcommit.rs
"
FILES=${FILES:-$DEFAULT_FILES}
JOBS=${JOBS-2}   # empty: no -j (cargo-mutants refuses -j with --in-place)
OUT=target/mutants

# Mutants known harmless, as cargo-mutants names them (a regex each, matched against the
# mutant's name in missed.txt), each with why no test can tell it from the code:
HARMLESS=(
  # A process NVML lists twice with equal readings: keeping either copy counts the same bytes
  # (same pid, same GPU, same /proc reading).
  'node/accounting\.rs:[0-9]+:[0-9]+: replace > with >= in one_per_process'
)

args=(mutants -p tessera-driver -o "$OUT" --no-shuffle)
if [[ -n "$JOBS" ]]; then
  args+=(-j "$JOBS")
fi
# Extra cargo-mutants flags, split on spaces.
read -r -a extra <<< "${MUTANTS_FLAGS:-}"
args+=("${extra[@]}")
for f in $FILES; do
  args+=(--file "$f")
done
mkdir -p "$OUT"
status=0
cargo "${args[@]}" -- --lib || status=$?
# cargo-mutants exits 2 when mutants were missed, 3 on timeouts; anything else is a failure of
# the run itself (4: the tests fail without any mutant).
case "$status" in
  0 | 2 | 3) ;;
  *) echo "cargo mutants failed (exit $status)" >&2; exit "$status" ;;
esac

missed="$OUT/mutants.out/missed.txt"
unlisted=()
if [[ -f "$missed" ]]; then
  while IFS= read -r mutant; do
    [[ -z "$mutant" ]] && continue
    known=0
    for pattern in "${HARMLESS[@]}"; do
      if [[ "$mutant" =~ $pattern ]]; then
        known=1
        break
      fi
    done
    if [[ "$known" -eq 0 ]]; then
      unlisted+=("$mutant")
    fi
  done < "$missed"
fi
if [[ -f "$OUT/mutants.out/timeout.txt" ]] && [[ -s "$OUT/mutants.out/timeout.txt" ]]; then
  echo "mutants that timed out (a loop the mutation made endless; count as caught):"
  sed 's/^/  /' "$OUT/mutants.out/timeout.txt"
fi
if [[ ${#unlisted[@]} -gt 0 ]]; then
  echo "missed mutants that are neither killed by a test nor listed as harmless in $0:"
  printf '  %s\n' "${unlisted[@]}"
  exit 1
fi
echo "every mutant is caught or listed as harmless"
