#!/usr/bin/env bash
# Session s's shortest device call (~220 s): the unit trace of HEAD's forward on the padded
# shapes, then mixed-serve on HEAD, the mixed order and the mixed order with key-split units
# (one process each). Carry .scratch/q2. Env: TRACE_S (90), SERVE_S (90).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
source benchmarks/calls/setup.sh
unpack .scratch/q2/site_trace.tar.xz site_trace || exit 1
mkdir -p "$OUT/trace"
(cd benchmarks && PYTHONPATH="$PWD/../.scratch/site_trace:$PYTHONPATH" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  timeout "${TRACE_S:-90}" python3 unit_trace.py d128-skewed d128-full d64-skewed --out "$OUT/trace/padded.json" 2>&1 \
  | grep -v "^WARNING\|^I0000\|^W0000" | tail -8 | tee "$OUT/trace/padded.md")
echo "trace done: $(( $(date +%s) - T0 )) s"
serve_ab ${SERVE_S:-90}
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
