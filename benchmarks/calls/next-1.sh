#!/usr/bin/env bash
# Session r's first device call (cold), written in session q: the whole suite over HEAD's
# kernels and over the staged-O experiment, then Nsight Compute on the d128-skewed forward:
# 7d8a538, HEAD and FA3, one warm launch each. Carry .scratch/q2 (sites.tar.xz with the prebuilt packages; whl/ with
# flash-attn3-jax, xdist, execnet).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
T0=$(date +%s)
python3 -c "import tarfile; tarfile.open('.scratch/q2/sites.tar.xz').extractall('.scratch')" || exit 1
mkdir -p .whl && cp .scratch/q2/whl/*.whl .whl/
for s in new staged; do
  PREBUILT=.scratch/site_$s PYTEST_ARGS="-n 8" TESTS_S=${TESTS_S:-130} TOTAL_S=140 bash benchmarks/h200.sh tests 2>&1 | tail -4
  mv "$OUT/gpu_tests.log" "$OUT/gpu_tests_$s.log"
done
export PYTHONPATH=/tmp/site  # h200.sh installed the wheels (FA3) there
VARIANTS="base=.scratch/site_base head=.scratch/site_new" SHAPES=d128-skewed NCU_REGEX=regex:fwd_sm90 \
  bash benchmarks/ncu_sites.sh
OUT=$OUT/fa3 VARIANTS="fa3=.scratch/site_new" SHAPES=d128-skewed NCU_CASE_ARGS=--fa3 \
  NCU_REGEX="regex:flash|Flash|device_kernel" bash benchmarks/ncu_sites.sh
echo "call: $(( $(date +%s) - T0 )) s"
cd "$OUT" && tar --exclude="*.ncu-rep" -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz "$OUT/"
