#!/usr/bin/env bash
# The next session's second device call (warm, right after u-1.sh, ~520 s): the whole GPU suite
# over HEAD (site_new: staged-O, the mixed order's fix), then the persistent split grid off and
# on (h200.sh persist: does it earn its 24 kernels and the 4 slowest tests? otherwise delete it),
# then issue 32's A/B of the rest of the named shapes against 7d8a538. Carry .scratch/q2.
# Results: $OUT/all.tgz. Env: SUITE_S (200), DEADLINE_S (520).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
source benchmarks/calls/setup.sh
unpack .scratch/q2/site_base.tar.xz site_base || exit 1
left() { echo $(( ${DEADLINE_S:-520} - ($(date +%s) - T0) )); }
OUT=$OUT/tests PREBUILT=.scratch/site_new PYTEST_ARGS="-n 8" TESTS_S=${SUITE_S:-200} TOTAL_S=$(( ${SUITE_S:-200} + 15 )) \
  bash benchmarks/h200.sh tests 2>&1 | tail -4
export PYTHONPATH=/tmp/site
echo "suite done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/persist PREBUILT=.scratch/site_new TOTAL_S=110 PERSIST_S=100 DECODE_SHAPES=decode-paged,decode-skewed \
  bash benchmarks/h200.sh persist 2>&1 | tail -8
echo "persist done: $(( $(date +%s) - T0 )) s"
(( $(left) > 90 )) && OUT=$OUT/ab32 VARIANTS="base=.scratch/site_base new=.scratch/site_new" PASSES=both ROUNDS=1 \
  STEP_S=5 SHAPES=d128-causal-skewed,prefill-right-padded,docs-causal-d64,d256-skewed BUDGET_S=$(( $(left) - 10 )) \
  bash benchmarks/ab_sites.sh
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
