#!/usr/bin/env bash
# Runs the GPU test suite (tests/gpu) on one wgpu backend in several processes at once, one
# module of the suite a process, each process one test at a time.
#
# Why: on Mesa's software adapters the suite's time is almost all LLVM compiling shader variants.
# GL (llvmpipe): wgpu's GL backend panics when a thread waits more than six seconds for the GL
# context, so one process runs one test at a time and keeps one core busy. Vulkan (lavapipe):
# the tests of one process share one device, whose queue compiles each pipeline at its first
# dispatch, again one core. Processes share nothing but Mesa's on-disk shader cache, so two of
# them use both cores of a CI machine.
#
# Usage: scripts/gpu-tests.sh BACKEND [JOBS [MODULE...]]
#   BACKEND: the WGPU_BACKEND the tests run on (gl, vulkan, metal or dx12);
#   JOBS: processes at once (default 2); MODULEs: only these modules of the suite (default all).
# Every test of the modules runs exactly once (by its exact name); the script fails when a
# module fails or runs another number of tests than it lists. Each module's log follows, with
# its time. The environment reaches the tests (KVATTN_MODEL, for instance).
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${1:-}
case "$backend" in
  gl | vulkan | metal | dx12) ;;
  *)
    echo "usage: scripts/gpu-tests.sh BACKEND [JOBS [MODULE...]]" \
      "(BACKEND: gl, vulkan, metal or dx12)" >&2
    exit 2
    ;;
esac
shift
jobs=${1:-2}
shift || true

bin=$(cargo test --all-features --test gpu --no-run 2>&1 |
  sed -n 's/.*Executable tests\/gpu\/main.rs (\(.*\))$/\1/p')
test -x "$bin" || { echo "error: no GPU test binary (cargo test --no-run)" >&2; exit 1; }

names=$(mktemp)
"$bin" --list 2>/dev/null | sed -n 's/: test$//p' > "$names"
if [ "$#" -gt 0 ]; then
  all=$(cat "$names")
  for module in "$@"; do
    grep -q "^$module::" <<< "$all" || { echo "error: no module $module in tests/gpu" >&2; exit 1; }
  done
  grep -E "^($(IFS='|'; echo "$*"))::" <<< "$all" > "$names"
fi
total=$(wc -l < "$names")
# The modules, those known to take longest on the software adapters first (so that the last ones
# to start are short: cold, paged_attention took 2,099 s on lavapipe and 1,136 s on llvmpipe, the
# next ones 300 to 600 s), then any others in name order.
heavy="paged_attention decode nan_semantics mla verify qmatmul decoder serve decoder_blocks"
modules=$( (for m in $heavy; do echo "$m"; done; cut -d: -f1 "$names" | sort -u) |
  awk '!seen[$0]++' | while read -r m; do if grep -q "^$m::" "$names"; then echo "$m"; fi; done)

logs=$(mktemp -d)
run_module() {
  local backend=$1 bin=$2 names=$3 logs=$4 module=$5 start rc=0
  start=$(date +%s)
  # shellcheck disable=SC2046
  WGPU_BACKEND=$backend "$bin" --exact --test-threads=1 \
    $(grep "^$module::" "$names") > "$logs/$module.log" 2>&1 || rc=$?
  echo "$rc $(( $(date +%s) - start ))" > "$logs/$module.rc"
}
export -f run_module
echo "$modules" |
  xargs -P "$jobs" -I{} bash -c 'run_module "$@"' _ "$backend" "$bin" "$names" "$logs" {}

failed=0
passed_all=0
for module in $modules; do
  read -r rc secs < "$logs/$module.rc"
  want=$(grep -c "^$module::" "$names")
  passed=$(sed -n 's/^test result: .*\. \([0-9]*\) passed;.*/\1/p' "$logs/$module.log")
  passed=${passed:-0}
  passed_all=$(( passed_all + passed ))
  echo "== $backend $module: $passed of $want passed in $secs s (exit $rc)"
  cat "$logs/$module.log"
  if [ "$rc" -ne 0 ] || [ "$passed" -ne "$want" ]; then
    failed=1
  fi
done
echo "$backend GPU tests: $passed_all of $total passed"
[ "$failed" -eq 0 ] && [ "$passed_all" -eq "$total" ]
