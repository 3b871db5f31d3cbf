#!/usr/bin/env bash
# One device call: build for sm_90a, run the GPU tests, then the benchmark; logs and results
# land in $OUT (the device tool brings them back). Usage, from the repository root:
#   bash benchmarks/h200.sh [tests] [bench] [decode] [sweep] [ncu]   (default: tests bench decode;
#   the sweep stage takes up to 240 s, so e.g. `bash benchmarks/h200.sh decode sweep`)
# Env: PYTEST_K selects GPU tests (-k), SHAPES the benchmark shapes, BENCH_ARGS more bench.py
# flags (e.g. --quick), TESTS_S / BENCH_S stage time limits, OUT the output folder.
set -u
R=$(pwd)
OUT=${OUT:-/tmp/out}
STAGES=${*:-tests bench decode}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps --target /tmp/site \
  -C cmake.define.JAX_VARLEN_CUDA_ARCHS=90a-real . >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(($(date +%s) - t0)) s"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp  # the source folder would shadow the installed package
for stage in $STAGES; do
  case $stage in
    tests) timeout ${TESTS_S:-270} python3 -m pytest "$R/tests/test_gpu_forward.py" "$R/tests/test_gpu_decode.py" -q -rP -p no:cacheprovider \
             --durations=5 -k "${PYTEST_K:-}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -12 ;;
    bench) timeout ${BENCH_S:-220} python3 "$R/benchmarks/bench.py" --out "$OUT" ${BENCH_ARGS:-} \
             ${SHAPES:+--shapes "$SHAPES"} 2>&1 | tail -14 ;;
    decode) timeout 90 python3 "$R/benchmarks/bench.py" --out "$OUT" --tag decode ${BENCH_ARGS:-} \
             --shapes decode-full,decode-skewed --decode 2>&1 | tail -6 ;;
    ncu) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 ncu --clock-control none --target-processes all -k "regex:fwd_(tc|split)_kernel" \
           --launch-count 4 --section SpeedOfLight --section Occupancy \
           --section WarpStateStats --section SchedulerStats --section LaunchStats \
           --section MemoryWorkloadAnalysis python3 "$R/benchmarks/ncu_case.py" ${NCU_SHAPES:-d128-full decode-full} \
           >"$OUT/ncu.log" 2>&1; grep -E "Duration|Throughput|Warp Cycles Per Issued|Achieved Occ|Registers" "$OUT/ncu.log" | head -40 ;;
    sweep) timeout 240 python3 "$R/benchmarks/decode_sweep.py" --out "$OUT" 2>&1 \
             | tee "$OUT/decode_sweep.log" | tail -24 ;;
  esac
done
