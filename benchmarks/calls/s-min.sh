#!/usr/bin/env bash
# Session s's short device call (~330 s, for when little device time is left): the unit trace;
# HEAD against the Q prefetch and the staged-O epilogue on d128-skewed and docs-causal; mixed-serve
# on HEAD, the mixed order and the mixed order with key-split units. Carry .scratch/q2.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
source benchmarks/calls/setup.sh
for s in site_trace site_qpf; do
  [[ -d .scratch/$s ]] || python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall('.scratch')" .scratch/q2/$s.tar.xz
done
OUT=$OUT/t timeout 100 bash benchmarks/calls/next-trace.sh
echo "trace done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/ab VARIANTS="head=.scratch/site_new qpf=.scratch/site_qpf staged=.scratch/site_staged" PASSES=fwd ROUNDS=1 \
  STEP_S=4 SHAPES=d128-skewed,docs-causal BUDGET_S=${AB_S:-150} bash benchmarks/ab_sites.sh
echo "ab done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/serve VARIANTS="head=.scratch/site_new mixed=.scratch/site_r@JAX_VARLEN_FWD_MIXED_ORDER=1 \
split=.scratch/site_r@JAX_VARLEN_FWD_MIXED_ORDER=1,JAX_VARLEN_FWD_KEY_SPLIT=1" SHAPES=mixed-serve PASSES=fwd \
  ROUNDS=1 STEP_S=4 BUDGET_S=${SERVE_S:-80} bash benchmarks/ab_sites.sh
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
