#!/usr/bin/env bash
# Mutation test of the node's safety rules: cargo-mutants (27.1) mutates each file below that
# decides isolation, preparation or accounting, and runs the driver's library tests against
# every mutant. A mutant that leaves every test green is a rule no test guards.
#
#   scripts/mutants.sh                  # the files and functions below, in 2 shards
#   FILES="driver/src/node/accounting.rs" scripts/mutants.sh
#   SHARDS=1 scripts/mutants.sh         # one shard (a machine with one core to spare)
#   MUTANTS_FLAGS="--timeout 120" scripts/mutants.sh
#   LIST=1 scripts/mutants.sh           # print the mutants it would test, and stop
#
# How it runs: the mutants are split into $SHARDS shards (cargo-mutants `--shard k/n`). Each
# shard mutates its own copy of the working tree (the files git tracks or would track, so
# uncommitted changes are tested) under target/mutants/tree-<k>, in place, with its own
# target/ seeded by hard links from this tree's target/debug (cargo rebuilds only the
# workspace's crates there, not the dependencies). The shards run side by side, so on two
# cores each core builds one mutant at a time. A shard's copy and target are kept, so a second
# run starts warm.
#
# Run it after changing a safety rule (docs/architecture.md). Not in CI: it takes about half an
# hour on two cores. It exits 1 when a missed mutant is not listed as harmless below, and
# prints those; each shard's results are under target/mutants/out-<k>/mutants.out/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# The files that decide isolation, preparation and accounting.
DEFAULT_FILES="
driver/src/node/prepare.rs
driver/src/node/prepare/card.rs
driver/src/node/inventory.rs
driver/src/node/inventory/mig_minors.rs
driver/src/node/accounting.rs
driver/src/node/isolation.rs
driver/src/node/checkpoint/holdings.rs
driver/src/rules/config.rs
driver/src/rules/tier.rs
driver/src/rules/overcommit.rs
"
FILES=${FILES:-$DEFAULT_FILES}
SHARDS=${SHARDS:-2}
OUT=target/mutants

# What those files hold that decides no safety rule, and is not mutated (a regex each, matched
# against the mutant's name as `cargo mutants --list` prints it), each with why:
NOT_SAFETY=(
  # inventory.rs: only `NodeInventory::mig_access` (which MIG instances the node can name) is a
  # safety rule; the rest is names, parsing of the fake-inventory file, and display.
  'inventory\.rs:.* in (Inventory::|Gpu::|GpuMode::|Isolation::|MigInstance::|<impl)'
  'inventory\.rs:[0-9]+:[0-9]+: replace (<impl|Inventory::|Gpu::|GpuMode::|Isolation::|MigInstance::)'
  # mig_minors.rs: the driver's usual numbering, which only simulated inventories use (a real
  # node reads the driver's table; docs/cdi.md).
  'mig_minors\.rs:.*(driver_layout|layout_minors)'
  'mig_minors\.rs:2[0-9]:'
  # config.rs: delay tolerance (scheduling, not isolation), and text: display, serialisation,
  # and parsing a factor from a command-line number (simulate's flags).
  'config\.rs:.*(Patience|<impl fmt::Display|<impl std::fmt::Display|<impl Serialize|Tier::as_str|Factor::from_f64)'
  # isolation.rs: when the next probe is due (the verdict and its application are kept), and
  # the text of a report.
  'isolation\.rs:.*(probe_due|ProbeRecord::retry_at| in due$|replace due |did_not_run|ProbeOutcome::failed| in mib$|replace mib )'
  # accounting.rs and prepare.rs: message text.
  'accounting\.rs:.*(OverBooking::message| in mib$|replace mib )'
  'prepare\.rs:.*claim_label'
)

# Mutants known harmless, as cargo-mutants names them (a regex each, matched against the
# mutant's name in missed.txt), each with why no test can tell it from the code:
HARMLESS=(
  # A process NVML lists twice with equal readings: keeping either copy counts the same bytes
  # (same pid, same GPU, same /proc reading).
  'node/accounting\.rs:[0-9]+:[0-9]+: replace > with >= in one_per_process'
  # A factor of 1.0 taken as over-committing: every use is a shortcut that gives the same
  # answer. `overcommit::book` would go on to find that the ask above the free room exceeds
  # 1.0 x capacity and refuse it as the shortcut does; the allocator's quick bound skips a
  # prefilter (more nodes looked at, the same placement); and a pod without over-commit
  # tried "without over-commit first" is placed twice the same way.
  'rules/config\.rs:[0-9]+:[0-9]+: replace Factor::overcommits -> bool with true'
  'rules/config\.rs:[0-9]+:[0-9]+: replace > with >= in Factor::overcommits'
  'rules/overcommit\.rs:[0-9]+:[0-9]+: replace Overcommit::any -> bool with true'
  # `count_sms` is called with a sign of 1 or -1, never 0: `sign >= 0` picks as `sign > 0`.
  'checkpoint/holdings\.rs:[0-9]+:[0-9]+: replace > with >= in Holdings::count_sms'
  # `check_sms` looping over every GPU of the claim rather than those with a share: for the
  # others (held whole, or as MIG instances) `gpu_threads` answers None and the loop skips them.
  'checkpoint/holdings\.rs:[0-9]+:[0-9]+: replace && with \|\| in Holdings::check_sms'
)

args=(mutants -p tessera-driver --no-shuffle --in-place)
# Extra cargo-mutants flags, split on spaces.
read -r -a extra <<< "${MUTANTS_FLAGS:-}"
args+=("${extra[@]}")
for f in $FILES; do
  args+=(--file "$f")
done
for pattern in "${NOT_SAFETY[@]}"; do
  args+=(--exclude-re "$pattern")
done

if [[ -n "${LIST:-}" ]]; then
  cargo "${args[@]}" --list
  exit 0
fi

mkdir -p "$OUT"
pids=()
for ((k = 0; k < SHARDS; k++)); do
  tree="$OUT/tree-$k"
  mkdir -p "$tree/target"
  # The working tree as git sees it (tracked and untracked-but-not-ignored files).
  git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - -cf - | tar -xf - -C "$tree"
  if [[ ! -e "$tree/target/debug" && -d target/debug ]]; then
    cp -al target/debug "$tree/target/debug"
    rm -f "$tree/target/debug/.cargo-lock"
  fi
  rm -rf "$OUT/out-$k"
  (
    cd "$tree"
    # `--lib` to every cargo command: the build phase too builds the library's tests alone,
    # not the crate's integration tests and examples as well.
    cargo "${args[@]}" --shard "$k/$SHARDS" -o "$root/$OUT/out-$k" --cargo-arg=--lib \
      > "$root/$OUT/shard-$k.log" 2>&1
  ) &
  pids+=("$!")
done

failed=0
for ((k = 0; k < SHARDS; k++)); do
  status=0
  wait "${pids[$k]}" || status=$?
  # cargo-mutants exits 2 when mutants were missed, 3 on timeouts; anything else is a failure
  # of the run itself (4: the tests fail without any mutant).
  case "$status" in
    0 | 2 | 3) ;;
    *)
      echo "shard $k: cargo mutants failed (exit $status); see $OUT/shard-$k.log" >&2
      failed=1
      ;;
  esac
done
[[ "$failed" -eq 0 ]] || exit 1

for kind in caught missed timeout unviable; do
  n=$(cat "$OUT"/out-*/mutants.out/"$kind".txt 2>/dev/null | grep -c . || true)
  echo "$kind: $n"
done

unlisted=()
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
done < <(cat "$OUT"/out-*/mutants.out/missed.txt 2>/dev/null || true)
if cat "$OUT"/out-*/mutants.out/timeout.txt 2>/dev/null | grep -q .; then
  echo "mutants that timed out (a loop the mutation made endless; count as caught):"
  cat "$OUT"/out-*/mutants.out/timeout.txt | sed 's/^/  /'
fi
if [[ ${#unlisted[@]} -gt 0 ]]; then
  echo "missed mutants that are neither killed by a test nor listed as harmless in $0:"
  printf '  %s\n' "${unlisted[@]}"
  exit 1
fi
echo "every mutant is caught or listed as harmless"
