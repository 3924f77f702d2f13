#!/usr/bin/env bash
# Runs the GPU test suite (tests/gpu) on GL (llvmpipe) in several processes at once, one module
# of the suite a process, each process one test at a time.
#
# Why: on llvmpipe the suite's time is almost all LLVM compiling shader variants on the thread
# that creates the pipeline, and wgpu's GL backend panics when a thread waits more than six
# seconds for the GL context, so one process runs one test at a time and keeps one core busy.
# Processes share nothing but Mesa's on-disk shader cache, so two of them use both cores of a
# CI machine once the Vulkan steps beside them are done.
#
# Usage: scripts/gl-gpu-tests.sh [JOBS [MODULE...]]
#   JOBS: processes at once (default 2); MODULEs: only these modules of the suite (default all).
# Every test of the modules runs exactly once (by its exact name); the script fails when a
# module fails or runs another number of tests than it lists. Each module's log follows, with
# its time.
set -euo pipefail
cd "$(dirname "$0")/.."
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
# The modules, those known to take longest on llvmpipe first (so that the last ones to start are
# short), then any others in name order.
heavy="decode decoder paged_attention nan_semantics mla paged decoder_blocks bench_cases"
modules=$( (for m in $heavy; do echo "$m"; done; cut -d: -f1 "$names" | sort -u) |
  awk '!seen[$0]++' | while read -r m; do grep -q "^$m::" "$names" && echo "$m"; done)

logs=$(mktemp -d)
run_module() {
  local bin=$1 names=$2 logs=$3 module=$4 start rc=0
  start=$(date +%s)
  # shellcheck disable=SC2046
  WGPU_BACKEND=gl "$bin" --exact --test-threads=1 \
    $(grep "^$module::" "$names") > "$logs/$module.log" 2>&1 || rc=$?
  echo "$rc $(( $(date +%s) - start ))" > "$logs/$module.rc"
}
export -f run_module
echo "$modules" | xargs -P "$jobs" -I{} bash -c 'run_module "$@"' _ "$bin" "$names" "$logs" {}

failed=0
passed_all=0
for module in $modules; do
  read -r rc secs < "$logs/$module.rc"
  want=$(grep -c "^$module::" "$names")
  passed=$(sed -n 's/^test result: .*\. \([0-9]*\) passed;.*/\1/p' "$logs/$module.log")
  passed=${passed:-0}
  passed_all=$(( passed_all + passed ))
  echo "== GL $module: $passed of $want passed in $secs s (exit $rc)"
  cat "$logs/$module.log"
  if [ "$rc" -ne 0 ] || [ "$passed" -ne "$want" ]; then
    failed=1
  fi
done
echo "GL GPU tests: $passed_all of $total passed"
[ "$failed" -eq 0 ] && [ "$passed_all" -eq "$total" ]
