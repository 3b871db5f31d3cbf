#!/usr/bin/env bash
# Session r's second device call (warm: within 30 s of the first's end): Nsight Compute on the
# d128-skewed forward, 7d8a538 against HEAD, one warm launch each; the persistent split grid
# off and on (is it worth its 24 kernels?); d128-skewed's forward bisected between 7d8a538 and 375b565, one process per build,
# interleaved; FA3's d128-skewed forward under Nsight Compute if time is left.
# Results come back as $OUT/all.tgz.
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
[[ -d .scratch/site_c3394de ]] || python3 -c "import tarfile; tarfile.open('.scratch/q2/sites.tar.xz').extractall('.scratch')"
mkdir -p .whl && cp .scratch/q2/whl/*.whl .whl/
OUT=$OUT/setup PREBUILT=.scratch/site_new TOTAL_S=60 CMD=true bash benchmarks/h200.sh cmd >/dev/null 2>&1
export PYTHONPATH=/tmp/site
# STAGED_TESTS=1: the whole suite over the staged build first (the first call's ran short).
if [[ ${STAGED_TESTS:-0} == 1 ]]; then
  OUT=$OUT/tests PREBUILT=.scratch/site_staged PYTEST_ARGS="-n 8" TESTS_S=150 TOTAL_S=160 \
    bash benchmarks/h200.sh tests 2>&1 | tail -4
  export PYTHONPATH=/tmp/site
fi
# MIXED=1 (the first call ran without site_mixed): the mixed order's A/B and tests first.
if [[ ${MIXED:-0} == 1 ]]; then
  python3 -c "import tarfile; tarfile.open('.scratch/q2/site_mixed.tar.xz').extractall('.scratch')"
  OUT=$OUT/mixed VARIANTS="head=.scratch/site_new mixed=.scratch/site_mixed@JAX_VARLEN_FWD_MIXED_ORDER=1 \
mixed_off=.scratch/site_mixed" SHAPES=mixed-serve PASSES=fwd ROUNDS=2 STEP_S=4 BUDGET_S=180 bash benchmarks/ab_sites.sh
  OUT=$OUT/tests_mixed PREBUILT=.scratch/site_mixed TESTS_S=60 TOTAL_S=70 PYTEST_K="mixed_order or serving_step" \
    bash benchmarks/h200.sh tests 2>&1 | tail -4
  export PYTHONPATH=/tmp/site
  echo "mixed done: $(( $(date +%s) - T0 )) s"
fi
NCU_VARIANT_S=70 VARIANTS="base=.scratch/site_base head=.scratch/site_new" SHAPES=d128-skewed NCU_REGEX=regex:fwd_sm90 \
  bash benchmarks/ncu_sites.sh
echo "ncu done: $(( $(date +%s) - T0 )) s"
OUT=$OUT/persist PREBUILT=.scratch/site_new TOTAL_S=100 PERSIST_S=90 DECODE_SHAPES=decode-paged,decode-skewed \
  bash benchmarks/h200.sh persist 2>&1 | tail -8
export PYTHONPATH=/tmp/site
left() { echo $(( 560 - ($(date +%s) - T0) )); }  # the stages below only where time is left
(( $(left) > 80 )) && OUT=$OUT/bisect VARIANTS="base=.scratch/site_base c3394de=.scratch/site_c3394de 38df106=.scratch/site_38df106 \
523a2ae=.scratch/site_523a2ae 9a16612=.scratch/site_9a16612 a_static=.scratch/site_375b565@JAX_VARLEN_DYNAMIC_UNITS=0 \
head=.scratch/site_new" SHAPES=d128-skewed PASSES=fwd ROUNDS=1 STEP_S=4 \
  BUDGET_S=$(( $(left) > 200 ? 130 : $(left) - 70 )) bash benchmarks/ab_sites.sh
echo "bisect done: $(( $(date +%s) - T0 )) s"
(( $(left) > 100 )) && OUT=$OUT/fa3 NCU_VARIANT_S=$(( $(left) - 20 )) VARIANTS="fa3=.scratch/site_new" SHAPES=d128-skewed NCU_CASE_ARGS=--fa3 \
  NCU_REGEX="regex:flash|Flash|device_kernel" bash benchmarks/ncu_sites.sh
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
