#!/usr/bin/env bash
# Session s's first device call (cold, ~560 s), in order: the unit trace of HEAD's forward
# (calls/next-trace.sh: where a unit's time beside its tiles goes); the forward of HEAD against
# the staged-O epilogue and the Q prefetch (pending/*-experiment.patch, prebuilt) on the shapes of
# many units, one round; mixed-serve on HEAD, the mixed order, the mixed order with key-split
# units, then FA3 packed beside both switches in one process; the switches' GPU tests. Carry
# .scratch/q2. Results: $OUT/all.tgz. Env: AB_S (150), SERVE_S (100), DEADLINE_S (560).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s); R=$(pwd)
source benchmarks/calls/setup.sh
unpack .scratch/q2/site_trace.tar.xz site_trace || exit 1
unpack .scratch/q2/site_qpf.tar.xz site_qpf || exit 1
unpack .scratch/q2/site_staged.tar.xz site_staged || exit 1
left() { echo $(( ${DEADLINE_S:-560} - ($(date +%s) - T0) )); }
OUT=$OUT/t timeout 110 bash benchmarks/calls/next-trace.sh
echo "trace done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/ab VARIANTS="head=.scratch/site_new staged=.scratch/site_staged qpf=.scratch/site_qpf" PASSES=fwd ROUNDS=1 \
  STEP_S=4 SHAPES=d128-skewed,d64-skewed,d128-full,docs-causal,mixed-serve BUDGET_S=${AB_S:-150} \
  bash benchmarks/ab_sites.sh
echo "ab done: $(( $(date +%s) - T0 )) s"
serve_ab ${SERVE_S:-100}
(cd /tmp && JAX_VARLEN_FWD_MIXED_ORDER=1 JAX_VARLEN_FWD_KEY_SPLIT=1 PYTHONPATH="$R/.scratch/site_r:$PYTHONPATH" \
  timeout 50 python3 "$R/benchmarks/bench.py" --out "$OUT/serve-peer" --tag serve-peer --passes fwd \
  --shapes mixed-serve --impls jax_varlen_packed,fa3_packed --extra-dtype none --no-plot --budget-s 38 \
  --step-budget-s 5 >"$OUT/serve-peer.log" 2>&1; grep -E "mixed-serve" "$OUT/serve-peer.log" | tail -4)
echo "serve done: $(( $(date +%s) - T0 )) s"
patch -p1 -N -s < benchmarks/pending/fwd-key-split-experiment.patch >/dev/null 2>&1 || echo "patch: not applied"
(( $(left) > 40 )) && OUT=$OUT/tests_r PREBUILT=.scratch/site_r TESTS_S=$(( $(left) - 10 )) TOTAL_S=$(left) \
  PYTEST_K="mixed_order or key_split or pack_gqa_serving" bash benchmarks/h200.sh tests 2>&1 | tail -4
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
