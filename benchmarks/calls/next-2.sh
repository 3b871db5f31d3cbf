#!/usr/bin/env bash
# Session r's second device call (warm: within 30 s of the first's end): STAGED_TESTS=1 (the
# staged-O experiment won in the first call) the whole suite over the staged build; this
# session's tree with its switches off against HEAD on the lean kernels' shapes (does the
# key-split code cost the default path?); then, where time is left, Nsight Compute on the
# d128-skewed forward (7d8a538 against HEAD) and the persistent split grid off and on.
# Results come back as $OUT/all.tgz.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
source benchmarks/calls/setup.sh
if [[ ${STAGED_TESTS:-0} == 1 ]]; then
  OUT=$OUT/tests PREBUILT=.scratch/site_staged PYTEST_ARGS="-n 8" TESTS_S=150 TOTAL_S=160 \
    bash benchmarks/h200.sh tests 2>&1 | tail -4
  export PYTHONPATH=/tmp/site
  echo "staged tests done: $(( $(date +%s) - T0 )) s"
fi
OUT=$OUT/off VARIANTS="head=.scratch/site_new r_off=.scratch/site_r" PASSES=fwd ROUNDS=2 STEP_S=4 \
  SHAPES=docs-causal,docs-causal-d64,mixed-serve,d128-causal-skewed,d64-skewed BUDGET_S=${OFF_S:-200} \
  bash benchmarks/ab_sites.sh
echo "off A/B done: $(( $(date +%s) - T0 )) s"
left() { echo $(( 560 - ($(date +%s) - T0) )); }  # the stages below only where time is left
(( $(left) > 150 )) && NCU_VARIANT_S=65 VARIANTS="base=.scratch/site_base head=.scratch/site_new" SHAPES=d128-skewed \
  NCU_REGEX=regex:fwd_sm90 bash benchmarks/ncu_sites.sh
(( $(left) > 90 )) && OUT=$OUT/persist PREBUILT=.scratch/site_new TOTAL_S=$(( $(left) - 5 )) PERSIST_S=$(( $(left) - 15 )) \
  DECODE_SHAPES=decode-paged,decode-skewed bash benchmarks/h200.sh persist 2>&1 | tail -8
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
