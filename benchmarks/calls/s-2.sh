#!/usr/bin/env bash
# Session s's second device call (warm, ~500 s): the whole GPU suite over site_r (main + the
# key-split patch, applied to this copy of the tree: its tests come with it; both switches off
# by default); site_r with its switches off against HEAD's kernels (site_new) on the lean kernels'
# shapes (does the key-split code cost the default path?); the persistent split grid off and on
# where time is left. Carry .scratch/q2. Results: $OUT/all.tgz.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
source benchmarks/calls/setup.sh
left() { echo $(( ${DEADLINE_S:-520} - ($(date +%s) - T0) )); }
patch -p1 -N -s < benchmarks/pending/fwd-key-split-experiment.patch >/dev/null 2>&1 || echo "patch: not applied"
OUT=$OUT/tests PREBUILT=.scratch/site_r PYTEST_ARGS="-n 8" TESTS_S=${SUITE_S:-170} TOTAL_S=$(( ${SUITE_S:-170} + 15 )) \
  bash benchmarks/h200.sh tests 2>&1 | tail -4
export PYTHONPATH=/tmp/site
echo "suite done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/off VARIANTS="head=.scratch/site_new r_off=.scratch/site_r" PASSES=fwd ROUNDS=1 STEP_S=4 \
  SHAPES=docs-causal,docs-causal-d64,mixed-serve,d128-causal-skewed,d64-skewed BUDGET_S=${OFF_S:-160} \
  bash benchmarks/ab_sites.sh
echo "off A/B done: $(( $(date +%s) - T0 )) s"
(( $(left) > 90 )) && OUT=$OUT/persist PREBUILT=.scratch/site_new TOTAL_S=$(( $(left) - 5 )) PERSIST_S=$(( $(left) - 15 )) \
  DECODE_SHAPES=decode-paged,decode-skewed bash benchmarks/h200.sh persist 2>&1 | tail -8
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
