#!/usr/bin/env bash
# Session t's first device call (cold, ~590 s), in order: the unit trace of HEAD's forward
# (calls/next-trace.sh); the forward of HEAD against the Q tile's L2 prefetch, its early release
# (after the unit's last Q K^T) and the first K before the Q wait (q3), two Q buffers (q2s), all
# four (q5) and the staged-O epilogue (staged), all prebuilt from pending/*-experiment.patch, on
# the shapes of many units, one round; the GPU forward tests over q5 in what time is left. Carry .scratch/q2. Results: $OUT/all.tgz. Env: AB_S (380),
# DEADLINE_S (590).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s); R=$(pwd)
source benchmarks/calls/setup.sh
for s in trace q3 q2s q5 staged; do unpack .scratch/q2/site_$s.tar.xz site_$s || exit 1; done
left() { echo $(( ${DEADLINE_S:-590} - ($(date +%s) - T0) )); }
OUT=$OUT/t timeout 110 bash benchmarks/calls/next-trace.sh
echo "trace done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/ab VARIANTS="head=.scratch/site_new q3=.scratch/site_q3 q2s=.scratch/site_q2s q5=.scratch/site_q5 \
staged=.scratch/site_staged" \
  PASSES=fwd ROUNDS=1 STEP_S=4 SHAPES=d128-skewed,d64-skewed,d128-full,docs-causal,mixed-serve BUDGET_S=${AB_S:-380} \
  bash benchmarks/ab_sites.sh
echo "ab done: $(( $(date +%s) - T0 )) s"
(( $(left) > 60 )) && OUT=$OUT/tests_q5 PREBUILT=.scratch/site_q5 PYTEST_ARGS="-n 8" TESTS_S=$(( $(left) - 15 )) \
  TOTAL_S=$(( $(left) - 5 )) TEST_FILES="tests/test_gpu_sm90.py tests/test_gpu_cuda.py tests/test_query_lengths.py \
tests/test_packed.py tests/test_forward.py tests/test_window_sinks.py tests/test_paged.py" bash benchmarks/h200.sh tests 2>&1 | tail -4
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
