#!/usr/bin/env bash
# Session r's first device call (cold), in priority order: the staged-O experiment against HEAD
# (forward, two interleaved rounds); this session's tree (site_r: the mixed order and key-split
# units, both behind switches) on mixed-serve -- HEAD, the mixed order, the mixed order with
# key-split units -- with FA3 packed beside the last in one process; the GPU tests of both
# switches. Carry .scratch/q2 (sites.tar.xz: the prebuilt packages; site_r.tar.xz; whl/:
# flash-attn3-jax, xdist, execnet). Results come back as $OUT/all.tgz. A shorter call (less
# device time left): e.g. ROUNDS_S=1 STAGED_S=150 SERVE_S=120 DEADLINE_S=430 (each process of
# ab_sites.sh needs its 25 s or more).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s); R=$(pwd)
source benchmarks/calls/setup.sh
OUT=$OUT/staged VARIANTS="head=.scratch/site_new staged=.scratch/site_staged" PASSES=fwd ROUNDS=${ROUNDS_S:-2} STEP_S=4 \
  SHAPES=d128-skewed,d64-skewed,d128-full,docs-causal,mixed-serve BUDGET_S=${STAGED_S:-190} \
  bash benchmarks/ab_sites.sh
echo "staged A/B done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/serve VARIANTS="head=.scratch/site_new mixed=.scratch/site_r@JAX_VARLEN_FWD_MIXED_ORDER=1 \
split=.scratch/site_r@JAX_VARLEN_FWD_MIXED_ORDER=1,JAX_VARLEN_FWD_KEY_SPLIT=1" SHAPES=mixed-serve PASSES=fwd \
  ROUNDS=${ROUNDS_S:-2} STEP_S=4 BUDGET_S=${SERVE_S:-180} bash benchmarks/ab_sites.sh
# The peer in the same process: FA3's packed varlen beside both switches (issue 33's ratio).
(cd /tmp && JAX_VARLEN_FWD_MIXED_ORDER=1 JAX_VARLEN_FWD_KEY_SPLIT=1 PYTHONPATH="$R/.scratch/site_r:$PYTHONPATH" \
  timeout 50 python3 "$R/benchmarks/bench.py" --out "$OUT/serve-peer" --tag serve-peer --passes fwd \
  --shapes mixed-serve --impls jax_varlen_packed,fa3_packed --extra-dtype none --no-plot --budget-s 38 \
  --step-budget-s 5 >"$OUT/serve-peer.log" 2>&1; grep -E "mixed-serve" "$OUT/serve-peer.log" | tail -4)
echo "serve done: $(( $(date +%s) - T0 )) s"
left() { echo $(( ${DEADLINE_S:-575} - ($(date +%s) - T0) )); }
# The key-split tests live in the pending patch: applied to this copy of the tree (its sources
# are site_r's already).
patch -p1 -N -s < benchmarks/pending/fwd-key-split-experiment.patch >/dev/null 2>&1 || echo "patch: not applied"
(( $(left) > 40 )) && OUT=$OUT/tests_r PREBUILT=.scratch/site_r TESTS_S=$(( $(left) - 10 )) TOTAL_S=$(left) \
  PYTEST_K="mixed_order or key_split or pack_gqa_serving" bash benchmarks/h200.sh tests 2>&1 | tail -4
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
