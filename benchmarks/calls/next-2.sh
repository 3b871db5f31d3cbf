#!/usr/bin/env bash
# Session r's second device call (warm: within 30 s of the first's end), written in session q:
# d128-skewed's forward bisected between 7d8a538 and 375b565, one process per build,
# interleaved (base and head again at the end); then the staged-O experiment against HEAD on
# the shapes with many units.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
[[ -d .scratch/site_c3394de ]] || python3 -c "import tarfile; tarfile.open('.scratch/q2/sites.tar.xz').extractall('.scratch')"
mkdir -p "$OUT/bisect" "$OUT/staged"
OUT=$OUT/bisect VARIANTS="base=.scratch/site_base c3394de=.scratch/site_c3394de 38df106=.scratch/site_38df106 \
523a2ae=.scratch/site_523a2ae 9a16612=.scratch/site_9a16612 a_static=.scratch/site_375b565@JAX_VARLEN_DYNAMIC_UNITS=0 \
head=.scratch/site_new base2=.scratch/site_base" SHAPES=d128-skewed PASSES=fwd ROUNDS=1 STEP_S=4 \
  BUDGET_S=${BISECT_S:-230} bash benchmarks/ab_sites.sh
OUT=$OUT/staged VARIANTS="head=.scratch/site_new staged=.scratch/site_staged" PASSES=fwd ROUNDS=2 STEP_S=4 \
  SHAPES=d128-skewed,docs-causal,mixed-serve,docs-causal-d64,d128-causal-skewed,d64-skewed BUDGET_S=${STAGED_S:-300} \
  bash benchmarks/ab_sites.sh
cd "$OUT" && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
