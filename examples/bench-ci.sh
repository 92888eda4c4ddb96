#!/usr/bin/env bash
# Gate a branch on speed: run `omlx bench` and compare it with a stored baseline run.
#
#   examples/bench-ci.sh [BASELINE.json]
#
# No baseline file yet: record one (run this on main) and exit 0.
# Baseline present: measure the same workload, print a Markdown report (also written to
# $REPORT), append the run to $HISTORY, and exit 1 if prefill tok/s / baseline is below
# $FAIL_BELOW at any context length; exit 2 if the workloads differ.
#
# Settings (environment): OMLX (command, default ./scripts/omlx), MODEL (default),
# CTX (512), GEN (128), REPEATS (5), FAIL_BELOW (0.9), REPORT (bench-report.md),
# HISTORY (bench-history.jsonl). Record and compare on the same kind of machine: the
# report warns when the hardware fingerprints differ.
set -euo pipefail

OMLX=${OMLX:-./scripts/omlx}
BASELINE=${1:-bench-baseline.json}
MODEL=${MODEL:-default}
CTX=${CTX:-512}
GEN=${GEN:-128}
REPEATS=${REPEATS:-5}
FAIL_BELOW=${FAIL_BELOW:-0.9}
REPORT=${REPORT:-bench-report.md}
HISTORY=${HISTORY:-bench-history.jsonl}

run=(bench --model "$MODEL" --ctx "$CTX" --gen "$GEN" --repeats "$REPEATS" --output "$HISTORY")

if [[ ! -f "$BASELINE" ]]; then
    "$OMLX" "${run[@]}" --format json > "$BASELINE.tmp"
    mv "$BASELINE.tmp" "$BASELINE"
    echo "bench-ci: recorded baseline $BASELINE (ctx $CTX, gen $GEN, $REPEATS repeats)" >&2
    exit 0
fi

# omlx exits 1 when the gate fails; pipefail hands that status on through tee.
"$OMLX" "${run[@]}" --against "$BASELINE" --fail-below "$FAIL_BELOW" --format md | tee "$REPORT"
