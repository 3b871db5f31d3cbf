#!/usr/bin/env bash
# The next session's first device call (cold, ~590 s), in order: the unit trace of HEAD's forward
# (staged-O landed: what a unit costs now; calls/next-trace.sh); the GPU tests of the serving
# switches over site_r (main + the key-split patch, applied to this copy so that its tests come
# along): the mixed order's bitwise test, whose scan bug session t fixed without a GPU, and the
# key-split units'; mixed-serve on HEAD, the mixed order and the mixed order with key-split units,
# then FA3 packed beside both switches; issue 32's A/B of HEAD against 7d8a538 (site_base) with
# what is left. Carry .scratch/q2 (site_new, site_r, site_trace, site_base, whl/).
# Results: $OUT/all.tgz. Env: SERVE_S (100), DEADLINE_S (590).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s); R=$(pwd)
source benchmarks/calls/setup.sh
for s in trace base; do unpack .scratch/q2/site_$s.tar.xz site_$s || exit 1; done
left() { echo $(( ${DEADLINE_S:-590} - ($(date +%s) - T0) )); }
OUT=$OUT/t timeout 100 bash benchmarks/calls/next-trace.sh
echo "trace done: $(( $(date +%s) - T0 )) s"
patch -p1 -N -s < benchmarks/pending/fwd-key-split-experiment.patch >/dev/null 2>&1 || echo "patch: not applied"
OUT=$OUT/tests_r PREBUILT=.scratch/site_r PYTEST_ARGS="-n 8" TESTS_S=80 TOTAL_S=90 \
  PYTEST_K="mixed_order or key_split or pack_gqa_serving" bash benchmarks/h200.sh tests 2>&1 | tail -4
export PYTHONPATH=/tmp/site
echo "tests done: $(( $(date +%s) - T0 )) s"
serve_ab ${SERVE_S:-100}
(cd /tmp && JAX_VARLEN_FWD_MIXED_ORDER=1 JAX_VARLEN_FWD_KEY_SPLIT=1 PYTHONPATH="$R/.scratch/site_r:$PYTHONPATH" \
  timeout 50 python3 "$R/benchmarks/bench.py" --out "$OUT/serve-peer" --tag serve-peer --passes fwd \
  --shapes mixed-serve --impls jax_varlen_packed,fa3_packed --extra-dtype none --no-plot --budget-s 38 \
  --step-budget-s 5 >"$OUT/serve-peer.log" 2>&1; grep -E "mixed-serve" "$OUT/serve-peer.log" | tail -4)
echo "serve done: $(( $(date +%s) - T0 )) s"
(( $(left) > 90 )) && OUT=$OUT/ab32 VARIANTS="base=.scratch/site_base new=.scratch/site_new" PASSES=both ROUNDS=1 \
  STEP_S=5 SHAPES=d128-skewed,d64-skewed,d128-full,docs-causal,mixed-serve BUDGET_S=$(( $(left) - 10 )) \
  bash benchmarks/ab_sites.sh
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
