#!/usr/bin/env bash
# Time shapes on several prebuilt packages (benchmarks/prebuild.sh, bundle_sites.sh) and runtime
# switches in one device call, interleaved, each against the first: h200.sh's ab stage (the base
# build against this one, issue 32 item 6) and a bisection of its SLOWER records. Run from the
# repository root on the device, after h200.sh's setup or on its own (it needs jax and the
# packages).
#   VARIANTS="base=.scratch/site_base new=.scratch/site_new new-plain0=.scratch/site_new@JAX_VARLEN_FWD_PLAIN=0"
#   SHAPES=d128-skewed,docs-causal PASSES=fwd ROUNDS=2 STEP_S=5 BUDGET_S=300 bash benchmarks/ab_sites.sh
# A variant is LABEL=SITE[@VAR=VALUE[,VAR=VALUE...]]: SITE (relative to the repository root, or
# absolute) goes first on PYTHONPATH, the variables into the environment. Each shape is timed by
# the impl of its layout (jax_varlen padded, jax_varlen_packed packed: bench.py --list-layout;
# a padded shape's packed call would double the work). Each round runs every variant once, one
# bench.py process per layout, each its share of BUDGET_S by shape count; PASSES fwd, train or
# both (the training step without the backward-alone record). ab_compare.py then compares each
# variant with the first, each record at its fastest over the rounds (a drift of the machine
# between processes falls on every side). Results: $OUT/sites/LABEL/*.json, $OUT/sites-LABEL.md.
set -uo pipefail
R=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/sites"
read -r -a variants <<<"${VARIANTS:?VARIANTS=\"label=site[@VAR=VALUE] ...\"}"
: "${SHAPES:?SHAPES=shape,...}"
rounds=${ROUNDS:-1}; budget=${BUDGET_S:-300}; t0=$(date +%s)
padded=$(python3 "$R/benchmarks/bench.py" --list-layout padded --shapes "$SHAPES")
packed=$(python3 "$R/benchmarks/bench.py" --list-layout packed --shapes "$SHAPES")
count() { tr ',' '\n' <<<"$1" | grep -c .; }
left=$((rounds * ${#variants[@]} * ($(count "$padded") + $(count "$packed"))))  # shape runs left
for round in $(seq 1 "$rounds"); do
  for v in "${variants[@]}"; do
    label=${v%%=*}; rest=${v#*=}; site=${rest%%@*}; envs=(); [[ $rest == *@* ]] && IFS=, read -r -a envs <<<"${rest#*@}"
    [[ $site == /* ]] || site=$R/$site
    for layout in padded packed; do
      shapes=$padded impl=jax_varlen; [[ $layout == packed ]] && shapes=$packed impl=jax_varlen_packed
      n=$(count "$shapes"); ((n == 0)) && continue
      share=$(( (budget - ($(date +%s) - t0)) * n / left )); left=$((left - n))
      ((share < 25)) && { echo "sites: $label $layout round $round skipped (time)"; continue; }
      (cd /tmp && env "${envs[@]}" PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout "$share" \
        python3 "$R/benchmarks/bench.py" --out "$OUT/sites/$label" --tag "$label-$layout-r$round" \
        --passes "${PASSES:-fwd}" --impls "$impl" --train-impls "$impl" --extra-dtype none --no-plot --no-bwd \
        --budget-s $((share - 10)) --step-budget-s "${STEP_S:-5}" --shapes "$shapes" \
        >"$OUT/sites/$label-$layout-r$round.log" 2>&1) \
        || echo "sites: $label $layout round $round exited $? (log: sites/$label-$layout-r$round.log)"
    done
  done
done
first=${variants[0]%%=*}
for v in "${variants[@]:1}"; do
  label=${v%%=*}
  python3 "$R/benchmarks/ab_compare.py" "$OUT/sites/$first" "$OUT/sites/$label" --out "$OUT/sites-$label.md" >/dev/null
  grep -h '^| [a-z0-9]' "$OUT/sites-$label.md" | sed "s/| bfloat16 //; s/^/$label /"
  tail -1 "$OUT/sites-$label.md" | sed "s/^/$label: /"
done
