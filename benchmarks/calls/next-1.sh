#!/usr/bin/env bash
# Session r's first device call (cold), in priority order: the staged-O experiment against HEAD
# on the shapes with many units (forward, two interleaved rounds); the whole suite over the
# staged build; then Nsight Compute on the d128-skewed forward, 7d8a538 against HEAD, one warm
# launch each. Carry .scratch/q2 (sites.tar.xz: the prebuilt packages; whl/: flash-attn3-jax,
# xdist, execnet). Results come back as $OUT/all.tgz.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
python3 -c "import tarfile; tarfile.open('.scratch/q2/sites.tar.xz').extractall('.scratch')" || exit 1
mkdir -p .whl && cp .scratch/q2/whl/*.whl .whl/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# h200.sh's setup only (the wheels into /tmp/site), through a stage that does nothing; each h200.sh
# run gets a folder of its own (past 8 files it archives its OUT).
OUT=$OUT/setup PREBUILT=.scratch/site_new TOTAL_S=60 CMD=true bash benchmarks/h200.sh cmd >/dev/null 2>&1
export PYTHONPATH=/tmp/site
OUT=$OUT/staged VARIANTS="head=.scratch/site_new staged=.scratch/site_staged" PASSES=fwd ROUNDS=2 STEP_S=4 \
  SHAPES=d128-skewed,docs-causal,mixed-serve,docs-causal-d64,d128-causal-skewed,d64-skewed,d128-full BUDGET_S=${STAGED_S:-240} \
  bash benchmarks/ab_sites.sh
echo "staged A/B done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/tests PREBUILT=.scratch/site_staged PYTEST_ARGS="-n 8" TESTS_S=${TESTS_S:-140} TOTAL_S=150 bash benchmarks/h200.sh tests 2>&1 | tail -4
echo "tests done: $(( $(date +%s) - T0 )) s"
export PYTHONPATH=/tmp/site
NCU_VARIANT_S=75 VARIANTS="base=.scratch/site_base head=.scratch/site_new" SHAPES=d128-skewed NCU_REGEX=regex:fwd_sm90 \
  bash benchmarks/ncu_sites.sh
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
