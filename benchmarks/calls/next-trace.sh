#!/usr/bin/env bash
# The Hopper forward's unit trace (benchmarks/unit_trace.py; a profiling build of this tree,
# .scratch/site_trace, bundled as .scratch/q2/site_trace.tar.xz): where a unit's time beside
# its tiles goes on the padded skewed and full shapes and the packed ones, ~60-90 s. Warm or
# cold; carry .scratch/q2. Results: $OUT/all.tgz.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s); R=$(pwd)
source benchmarks/calls/setup.sh
unpack .scratch/q2/site_trace.tar.xz site_trace || exit 1
mkdir -p "$OUT/trace"
run() { (cd "$R/benchmarks" && PYTHONPATH="$R/.scratch/site_trace:$PYTHONPATH" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  timeout 120 python3 unit_trace.py "$@" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -12); }
run d128-skewed d64-skewed d128-full d128-causal-skewed --out "$OUT/trace/padded.json" --raw "$OUT/trace" | tee "$OUT/trace/padded.md"
run --packed docs-causal docs-causal-d64 mixed-serve d128-skewed --out "$OUT/trace/packed.json" --raw "$OUT/trace" | tee "$OUT/trace/packed.md"
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
