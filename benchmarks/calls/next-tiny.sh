#!/usr/bin/env bash
# Session r's smallest call (~170 s of wall): the GPU tests of the mixed order and key-split
# units (site_r), then both switches against HEAD on mixed-serve, one process each. Carry
# .scratch/q2. Results: $OUT/all.tgz.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
source benchmarks/calls/setup.sh
patch -p1 -N -s < benchmarks/pending/fwd-key-split-experiment.patch >/dev/null 2>&1 || echo "patch: not applied"
OUT=$OUT/tests_r PREBUILT=.scratch/site_r TESTS_S=70 TOTAL_S=100 PYTEST_K="mixed_order or key_split" \
  bash benchmarks/h200.sh tests 2>&1 | tail -4
export PYTHONPATH=/tmp/site
echo "tests done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/serve VARIANTS="head=.scratch/site_new split=.scratch/site_r@JAX_VARLEN_FWD_MIXED_ORDER=1,JAX_VARLEN_FWD_KEY_SPLIT=1" \
  SHAPES=mixed-serve PASSES=fwd ROUNDS=1 STEP_S=4 BUDGET_S=$(( 170 - ($(date +%s) - T0) )) bash benchmarks/ab_sites.sh
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
