#!/usr/bin/env bash
# One device call: install the carried wheels, build for sm_90a, run the chosen stages; logs and
# results land in $OUT (the device tool brings them back). Usage, from the repository root:
#   bash benchmarks/h200.sh [tests] [bench] [train] [decode] [chunks] [persist] [plain]
#                           [sweep] [sinks] [ab] [ncu] [cmd]
#   (default: tests bench)
# Stages: tests = the suite's gpu-marked tests (each backend-parametrized test's GPU case and the
# GPU-only files tests/test_gpu_*.py); bench = the forward on bench.py's FWD_SHAPES (issue 11's
# eight and prefill-right-padded; bf16, plus f16 of d128-full and d128-skewed), jax_varlen /
# cuDNN / FA3 / XLA and the packed pair; train = train + bwd records (jax_varlen / cuDNN / FA3
# and the packed pair) on TRAIN_SHAPES (seven); decode = the decode shapes; chunks = the decode
# shapes at each split-KV chunk of CHUNKS ("1024 2048 4096", CHUNKS_S 150 s); persist = the decode
# shapes with split-KV on a persistent grid off and on (PERSIST_S 120 s); plain = the Hopper forward's plain-tile
# loop off and on (JAX_VARLEN_FWD_PLAIN) on PLAIN_SHAPES (docs-causal, docs-causal-d64,
# mixed-serve, d128-causal-skewed, d128-full, d128-skewed; PLAIN_S 100 s); sweep = the
# decode sweep; sinks = benchmarks/sinks_cost.py (d128-full with and without sinks, SINKS_S,
# 120 s); ab = a base build against this one (AB_BASE, AB_SHAPES, AB_PASSES, AB_S 500 s; see the stage);
# ncu = Nsight Compute on one call of each forward kernel; cmd = the shell command
# $CMD (run from /tmp with the build installed, $R = the repository root; limit CMD_S, 120 s).
# The whole call is held to TOTAL_S (default 540 s, from the start of this script): each stage's
# limit is cut to what is left, a stage with under 30 s left is skipped, and bench.py is told
# to stop starting measurements in time to write its files (they are rewritten after every
# shape, so a stage cut short keeps what finished).
# Env: TOTAL_S; stage limits TESTS_S (300) BENCH_S (270) TRAIN_S (400) DECODE_S (120)
#   SWEEP_S (240) NCU_S (200); DECODE_SHAPES (decode; default decode-full,decode-skewed,
#   decode-paged), DECODE_IMPLS (default: the padded impls and the paged pair); TEST_FILES (default tests; files or folders, from the repo
#   root), PYTEST_M (-m, default gpu; empty for every test), PYTEST_K (-k), HANG_S (a test
#   running longer dumps every thread's stack into gpu_tests.log, default 100: a kernel that
#   hangs names its test instead of stalling the suite silently), PYTEST_ARGS (more
#   pytest flags, e.g. "-n 6" with pytest-xdist's wheel in .whl/: processes share the GPU, so
#   XLA_PYTHON_CLIENT_PREALLOCATE=false is set for them); SHAPES (bench),
#   TRAIN_SHAPES (train), BENCH_ARGS / TRAIN_ARGS (more bench.py flags, e.g. --quick), STEP_S
#   (train: timing bound per measurement, default 15); NCU_SHAPES, NCU_REGEX, NCU_GRAD
#   (non-empty: profile gradients, e.g. with NCU_REGEX=regex:bwd_); AB_BASE, AB_SHAPES,
#   AB_PASSES (ab: "both" by default, or fwd / train), AB_S, AB_ROUNDS (1; n: base and new
#   interleaved n times, each record's fastest counts), AB_BASE_SITE (the base prebuilt);
#   PREBUILT (this tree's package built before the call by benchmarks/prebuild.sh, carried: no
#   build on the device); CMAKE_DEFINES (this tree's build only, e.g.
#   "JAX_VARLEN_CUDA_UNITS=instantiation"); OUT (output folder,
#   default /tmp/out).
# A folder .whl/ in the repository root (carried to the device) is installed first, into
# /tmp/site with --no-deps: flash-attn3-jax (the FA3 peer) and nvidia-cutlass (the CUTLASS/CuTe
# headers the sm_90a build finds through `import cutlass_library`).
set -u
T0=$(date +%s)
R=$(pwd)
OUT=${OUT:-/tmp/out}
STAGES=${*:-tests bench}
TOTAL_S=${TOTAL_S:-540}
mkdir -p "$OUT" /tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1  # before the build: cutlass_library from here

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 \
    || { tail -20 "$OUT/wheels.log"; exit 1; }
  echo "wheels: $(cd .whl && echo *.whl) ($(($(date +%s) - T0)) s)"
fi
t0=$(date +%s)
# --upgrade: on a machine kept warm from an earlier call, replace the jax_varlen built then;
# build/h200 (ignored, kept on the device between calls) makes that rebuild incremental.
defines=(); for d in ${CMAKE_DEFINES:-}; do defines+=(-C "cmake.define.$d"); done
if [[ -n ${PREBUILT:-} ]]; then  # built before the call (benchmarks/prebuild.sh), carried
  [[ -z ${CMAKE_DEFINES:-} ]] || { echo "CMAKE_DEFINES has no effect on a PREBUILT package: pass them to its build"; exit 1; }
  rm -rf /tmp/site/jax_varlen /tmp/site/jax_varlen-*.dist-info && cp -r "$R/$PREBUILT/." /tmp/site/ || exit 1
  echo "build: prebuilt $PREBUILT"
else
  python3 -m pip install --no-build-isolation --no-deps --upgrade --target /tmp/site \
    -C build-dir=build/h200 -C cmake.define.JAX_VARLEN_CUDA_ARCHS=90a-real "${defines[@]}" . \
    >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $(($(date +%s) - t0)) s"
fi

# limit STAGE_DEFAULT: the stage's time limit, cut to what is left of TOTAL_S (less 10 s to
# copy results); prints nothing when under 30 s would be left.
# knob NAME VAR "VALUES" SHAPES IMPLS FIRST_IMPLS: one bench.py forward process per value of
# environment variable VAR (read per call by the plan), equal shares of the stage's limit $L, the
# peers (FIRST_IMPLS) in the first process only; logs $OUT/NAME<value>.log.
knob() {
  local name=$1 var=$2 shapes=$4 impls=$5 first_impls=$6 first=1 a share
  set -- $3
  share=$((L / $#))
  for a in "$@"; do
    env "$var=$a" timeout "$share" python3 "$R/benchmarks/bench.py" --out "$OUT/$name$a" \
      --tag "$name" --budget-s $((share - 15)) --no-plot --extra-dtype none \
      --shapes "$shapes" --impls "$( ((first)) && echo "$first_impls" || echo "$impls")" >"$OUT/$name$a.log" 2>&1
    echo "$name $a:"; grep -E "^  [a-z0-9-]+ +bf16" "$OUT/$name$a.log" | grep -v skipped | cut -c1-110
    first=0
  done
}
# decode_knob NAME VAR "VALUES": one bench.py decode process per value of environment variable
# VAR on DECODE_SHAPES, equal shares of the stage's limit $L, FA3 (padded and paged) in the
# first process only; logs $OUT/NAME<value>.log.
decode_knob() {
  local name=$1 var=$2 first=1 a share impls
  set -- $3
  share=$((L / $#))
  for a in "$@"; do
    impls=jax_varlen,jax_varlen_paged; ((first)) && impls=jax_varlen,jax_varlen_paged,fa3,fa3_paged
    env "$var=$a" timeout "$share" python3 "$R/benchmarks/bench.py" --out "$OUT/$name$a" \
      --tag decode --decode --budget-s $((share - 15)) --no-plot --extra-dtype none \
      --shapes "${DECODE_SHAPES:-decode-full,decode-skewed,decode-paged}" --impls "$impls" \
      >"$OUT/$name$a.log" 2>&1
    echo "$name $a:"; grep -E "^\| decode" "$OUT/$name$a.log" | grep -v skipped | cut -c1-110
    first=0
  done
}
limit() {
  local left=$((TOTAL_S - ($(date +%s) - T0) - 10))
  ((left < 30)) && return 1
  ((left < $1)) && echo "$left" || echo "$1"
}
# summary LOG: bench.py's closing summary table, or the log's tail if it did not get there.
summary() {
  if grep -q '^Summary' "$1"; then sed -n '/^Summary/,$p' "$1"; else tail -15 "$1"; fi
}

cd /tmp  # the source folder would shadow the installed package
python3 -c "import jax, jax_varlen; print('jax', jax.__version__, jax.devices()[0].device_kind, \
'| jax_varlen', jax_varlen.__file__)" 2>&1 | tail -1
for stage in $STAGES; do
  t0=$(date +%s)
  case $stage in
    tests) L=$(limit "${TESTS_S:-300}") || { echo "tests: skipped (time)"; continue; }
      pre=(env)
      [[ " ${PYTEST_ARGS:-} " == *" -n "* ]] && pre=(env XLA_PYTHON_CLIENT_PREALLOCATE=false)
      files=${TEST_FILES:-tests}
      timeout "$L" "${pre[@]}" python3 -m pytest $(cd "$R" && for f in $files; do echo "$R/$f"; done) \
        -q -rP -p no:cacheprovider --durations=5 -o faulthandler_timeout="${HANG_S:-100}" \
        -m "${PYTEST_M-gpu}" -k "${PYTEST_K:-}" ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -12 ;;
    bench) L=$(limit "${BENCH_S:-270}") || { echo "bench: skipped (time)"; continue; }
      timeout "$L" python3 "$R/benchmarks/bench.py" --out "$OUT" --passes fwd \
        --budget-s $((L - 30)) ${BENCH_ARGS:-} ${SHAPES:+--shapes "$SHAPES"} \
        >"$OUT/bench.log" 2>&1
      summary "$OUT/bench.log" ;;
    train) L=$(limit "${TRAIN_S:-400}") || { echo "train: skipped (time)"; continue; }
      timeout "$L" python3 "$R/benchmarks/bench.py" --out "$OUT" --passes train \
        --budget-s $((L - 45)) --step-budget-s "${STEP_S:-15}" ${TRAIN_ARGS:-} \
        ${TRAIN_SHAPES:+--shapes "$TRAIN_SHAPES"} >"$OUT/train.log" 2>&1
      summary "$OUT/train.log" ;;
    decode) L=$(limit "${DECODE_S:-120}") || { echo "decode: skipped (time)"; continue; }
      timeout "$L" python3 "$R/benchmarks/bench.py" --out "$OUT" --tag decode --decode \
        --budget-s $((L - 20)) ${BENCH_ARGS:-} --shapes "${DECODE_SHAPES:-decode-full,decode-skewed,decode-paged}" \
        --impls "${DECODE_IMPLS:-jax_varlen,cudnn,fa3,xla,jax_varlen_paged,fa3_paged}" \
        >"$OUT/decode.log" 2>&1
      grep -E "^\| decode" "$OUT/decode.log" || tail -8 "$OUT/decode.log" ;;
    persist) L=$(limit "${PERSIST_S:-120}") || { echo "persist: skipped (time)"; continue; }
      # Split-KV on a persistent grid off and on (JAX_VARLEN_SPLIT_PERSISTENT, plan.h).
      decode_knob persist JAX_VARLEN_SPLIT_PERSISTENT "0 1" ;;
    chunks) L=$(limit "${CHUNKS_S:-150}") || { echo "chunks: skipped (time)"; continue; }
      # The split-KV chunk (JAX_VARLEN_SPLIT_KEYS, plan.h: one constant per process).
      decode_knob chunk JAX_VARLEN_SPLIT_KEYS "${CHUNKS:-1024 2048 4096}" ;;
    sinks) L=$(limit "${SINKS_S:-120}") || { echo "sinks: skipped (time)"; continue; }
      timeout "$L" python3 "$R/benchmarks/sinks_cost.py" --out "$OUT" >"$OUT/sinks.log" 2>&1
      tail -5 "$OUT/sinks.log" ;;
    ab) L=$(limit "${AB_S:-500}") || { echo "ab: skipped (time)"; continue; }
      # Issue 32 item 6: the base build against this one, in this call. AB_BASE is the base's
      # source tree relative to the repository root (made before the call with
      # `git archive BASE | tar -x -C .scratch/base`, carried with .scratch); it is built into
      # /tmp/site_base and put first on PYTHONPATH for the base's runs. Both run this tree's
      # bench.py (which passes the newer arguments only where a shape uses them) on AB_SHAPES
      # (default: every named padded and packed shape), AB_PASSES ("both": forward and training
      # step), through ab_sites.sh (each shape by the impl of its layout, one process per layout
      # and side; the ratios in ab.md). ~110 s per side at STEP_S 6 on an H100.
      t1=$(date +%s)
      mkdir -p /tmp/site_base
      if [[ -n ${AB_BASE_SITE:-} ]]; then  # the base built before the call (benchmarks/prebuild.sh)
        rm -rf /tmp/site_base/jax_varlen* && cp -r "$R/$AB_BASE_SITE/." /tmp/site_base/ || continue
        echo "ab: base prebuilt $AB_BASE_SITE"
      else
        (cd "$R/${AB_BASE:?the ab stage needs AB_BASE or AB_BASE_SITE}" && python3 -m pip install \
          --no-build-isolation --no-deps --upgrade --target /tmp/site_base -C build-dir=build/h200-base \
          -C cmake.define.JAX_VARLEN_CUDA_ARCHS=90a-real . >"$OUT/ab-build.log" 2>&1) \
          || { tail -20 "$OUT/ab-build.log"; continue; }
        echo "ab: base build $(($(date +%s) - t1)) s"
      fi
      # ab_sites.sh times both, base first, AB_ROUNDS interleaved, with what is left of L.
      (cd "$R" && OUT=$OUT/ab VARIANTS="base=/tmp/site_base new=/tmp/site" PASSES="${AB_PASSES:-both}" \
        SHAPES=${AB_SHAPES:-d128-full,d128-skewed,d64-skewed,d128-causal-skewed,prefill-right-padded,docs-causal,docs-causal-d64,mixed-serve,d256-skewed} \
        ROUNDS=${AB_ROUNDS:-1} STEP_S=${STEP_S:-6} BUDGET_S=$((L - ($(date +%s) - t0))) bash benchmarks/ab_sites.sh) | tail -4
      cp "$OUT/ab/sites-new.md" "$OUT/ab.md" ;;
    ncu) L=$(limit "${NCU_S:-200}") || { echo "ncu: skipped (time)"; continue; }
      # fwd_tc_kernel / fwd_split_kernel (sm80 path) and fwd_sm90_kernel (Hopper path)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$L" ncu --clock-control none \
        --target-processes all -k "${NCU_REGEX:-regex:fwd_(tc|split|sm90)[A-Za-z0-9_]*_kernel}" \
        --launch-count 4 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        --section MemoryWorkloadAnalysis \
        python3 "$R/benchmarks/ncu_case.py" ${NCU_GRAD:+--grad} ${NCU_SHAPES:-d128-full decode-full} \
        >"$OUT/ncu.log" 2>&1
      grep -E "^  [A-Za-z0-9_]+_kernel|Duration|Throughput|Warp Cycles Per Issued|Achieved Occ|Registers" \
        "$OUT/ncu.log" | head -48 ;;
    sweep) L=$(limit "${SWEEP_S:-240}") || { echo "sweep: skipped (time)"; continue; }
      timeout "$L" python3 "$R/benchmarks/decode_sweep.py" --out "$OUT" \
        --budget-s $((L - 30)) 2>&1 | tee "$OUT/decode_sweep.log" | tail -24 ;;
    plain) L=$(limit "${PLAIN_S:-100}") || { echo "plain: skipped (time)"; continue; }
      # The Hopper forward's loop of plain tiles (JAX_VARLEN_FWD_PLAIN, plan.h) off and on.
      knob plain JAX_VARLEN_FWD_PLAIN "0 1" "${PLAIN_SHAPES:-docs-causal,docs-causal-d64,mixed-serve,d128-causal-skewed,d128-full,d128-skewed}" \
        jax_varlen,jax_varlen_packed jax_varlen,jax_varlen_packed,fa3_packed,fa3,dew3 ;;
    cmd) L=$(limit "${CMD_S:-120}") || { echo "cmd: skipped (time)"; continue; }
      R="$R" timeout "$L" bash -c "$CMD" 2>&1 | tee "$OUT/cmd.log" | tail -24 ;;
    *) echo "unknown stage $stage (tests bench train decode chunks persist plain sweep sinks ab ncu cmd)"; continue ;;
  esac
  echo "$stage: $(($(date +%s) - t0)) s (call so far $(($(date +%s) - T0)) s of ${TOTAL_S})"
done
# The device tool brings back a few files of $OUT at most: past 8, everything goes into one archive.
if (($(find "$OUT" -type f | wc -l) > 8)); then
  tar czf /tmp/out-all.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/out-all.tgz "$OUT/all.tgz"
  echo "results: $OUT/all.tgz"
fi
