#!/usr/bin/env bash
# Session s's short device call (~330 s, for when little device time is left): the unit trace;
# HEAD against the Q prefetch and the staged-O epilogue on d128-skewed and docs-causal; mixed-serve
# on HEAD, the mixed order and the mixed order with key-split units. Carry .scratch/q2.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
source benchmarks/calls/setup.sh
unpack .scratch/q2/site_trace.tar.xz site_trace || exit 1
unpack .scratch/q2/site_qpf.tar.xz site_qpf || exit 1
unpack .scratch/q2/site_staged.tar.xz site_staged || exit 1
OUT=$OUT/t timeout 100 bash benchmarks/calls/next-trace.sh
echo "trace done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/ab VARIANTS="head=.scratch/site_new qpf=.scratch/site_qpf staged=.scratch/site_staged" PASSES=fwd ROUNDS=1 \
  STEP_S=4 SHAPES=d128-skewed,docs-causal BUDGET_S=${AB_S:-150} bash benchmarks/ab_sites.sh
echo "ab done: $(( $(date +%s) - T0 )) s"
serve_ab ${SERVE_S:-80}
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
