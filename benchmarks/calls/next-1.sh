#!/usr/bin/env bash
# Session r's first device call (cold), in priority order: the staged-O experiment against HEAD
# on the shapes with many units (forward, two interleaved rounds); the mixed order
# (JAX_VARLEN_FWD_MIXED_ORDER=1; site_mixed, this session's tree) against HEAD on mixed-serve,
# and its GPU tests; the whole suite over the staged build. Carry .scratch/q2 (sites.tar.xz: the
# prebuilt packages; site_mixed.tar.xz; whl/: flash-attn3-jax, xdist, execnet). Results come
# back as $OUT/all.tgz.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s); R=$(pwd)
python3 -c "import tarfile; tarfile.open('.scratch/q2/sites.tar.xz').extractall('.scratch')" || exit 1
mixed=0  # the mixed order's stages only where its package came
[[ -f .scratch/q2/site_mixed.tar.xz ]] && python3 -c "import tarfile; tarfile.open('.scratch/q2/site_mixed.tar.xz').extractall('.scratch')" && mixed=1
mkdir -p .whl && cp .scratch/q2/whl/*.whl .whl/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# h200.sh's setup only (the wheels into /tmp/site), through a stage that does nothing; each h200.sh
# run gets a folder of its own (past 8 files it archives its OUT).
OUT=$OUT/setup PREBUILT=.scratch/site_new TOTAL_S=60 CMD=true bash benchmarks/h200.sh cmd >/dev/null 2>&1
export PYTHONPATH=/tmp/site
OUT=$OUT/staged VARIANTS="head=.scratch/site_new staged=.scratch/site_staged" PASSES=fwd ROUNDS=2 STEP_S=4 \
  SHAPES=d128-skewed,docs-causal,mixed-serve,docs-causal-d64,d128-causal-skewed,d64-skewed,d128-full BUDGET_S=${STAGED_S:-210} \
  bash benchmarks/ab_sites.sh
echo "staged A/B done: $(( $(date +%s) - T0 )) s"
((mixed)) && OUT=$OUT/mixed VARIANTS="head=.scratch/site_new mixed=.scratch/site_mixed@JAX_VARLEN_FWD_MIXED_ORDER=1 \
mixed_off=.scratch/site_mixed" SHAPES=mixed-serve PASSES=fwd ROUNDS=2 STEP_S=4 BUDGET_S=${MIXED_S:-180} \
  bash benchmarks/ab_sites.sh
# The peer in the same process: FA3's packed varlen beside the mixed order (issue 33's ratio).
((mixed)) && (cd /tmp && JAX_VARLEN_FWD_MIXED_ORDER=1 PYTHONPATH="$R/.scratch/site_mixed:$PYTHONPATH" timeout 60 \
  python3 "$R/benchmarks/bench.py" --out "$OUT/mixed-peer" --tag mixed-peer --passes fwd --shapes mixed-serve \
  --impls jax_varlen_packed,fa3_packed --extra-dtype none --no-plot --budget-s 50 --step-budget-s 5 \
  >"$OUT/mixed-peer.log" 2>&1; grep -E "mixed-serve" "$OUT/mixed-peer.log" | tail -4)
((mixed)) && OUT=$OUT/tests_mixed PREBUILT=.scratch/site_mixed TESTS_S=60 TOTAL_S=70 PYTEST_K="mixed_order or serving_step" \
  bash benchmarks/h200.sh tests 2>&1 | tail -4
echo "mixed done: $(( $(date +%s) - T0 )) s"
left() { echo $(( 570 - ($(date +%s) - T0) )); }
(( $(left) > 60 )) && OUT=$OUT/tests PREBUILT=.scratch/site_staged PYTEST_ARGS="-n 8" TESTS_S=$(( $(left) - 10 )) \
  TOTAL_S=$(left) bash benchmarks/h200.sh tests 2>&1 | tail -4
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
