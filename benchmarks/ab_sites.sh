#!/usr/bin/env bash
# Time a few shapes on several prebuilt packages (benchmarks/prebuild.sh) and runtime switches in
# one device call, interleaved, to find which step between two builds moved a shape (a bisection
# of an A/B's SLOWER record). Run from the repository root on the device, after h200.sh's setup
# or on its own (it needs only jax and the carried packages). IMPLS: jax_varlen (default), or
# jax_varlen_packed for packed shapes (one layout per run: bench.py would time a padded shape's
# packed call too).
#   VARIANTS="base=.scratch/site_base new=.scratch/site_new new-plain0=.scratch/site_new@JAX_VARLEN_FWD_PLAIN=0"
#   SHAPES=d128-skewed PASSES=fwd ROUNDS=2 STEP_S=5 BUDGET_S=300 bash benchmarks/ab_sites.sh
# A variant is LABEL=SITE[@VAR=VALUE[,VAR=VALUE...]]: SITE (relative to the repository root) goes
# first on PYTHONPATH, the variables into the environment. Each round runs every variant once
# (one bench.py process each, its share of BUDGET_S); ab_compare.py then compares each variant
# with the first, each record at its fastest over the rounds. Results: $OUT/sites/LABEL/*.json,
# $OUT/sites.md.
set -uo pipefail
R=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/sites"
read -r -a variants <<<"${VARIANTS:?VARIANTS=\"label=site[@VAR=VALUE] ...\"}"
rounds=${ROUNDS:-1}; budget=${BUDGET_S:-300}; t0=$(date +%s)
runs_left=$((rounds * ${#variants[@]}))
for round in $(seq 1 "$rounds"); do
  for v in "${variants[@]}"; do
    label=${v%%=*}; rest=${v#*=}; site=${rest%%@*}; envs=(); [[ $rest == *@* ]] && IFS=, read -r -a envs <<<"${rest#*@}"
    share=$(( (budget - ($(date +%s) - t0)) / runs_left )); runs_left=$((runs_left - 1))
    ((share < 25)) && { echo "sites: $label round $round skipped (time)"; continue; }
    (cd /tmp && env "${envs[@]}" PYTHONPATH="$R/$site${PYTHONPATH:+:$PYTHONPATH}" timeout "$share" \
      python3 "$R/benchmarks/bench.py" --out "$OUT/sites/$label" --tag "$label-r$round" \
      --passes "${PASSES:-fwd}" --impls "${IMPLS:-jax_varlen}" --train-impls "${IMPLS:-jax_varlen}" \
      --extra-dtype none --no-plot --no-bwd --budget-s $((share - 10)) --step-budget-s "${STEP_S:-5}" \
      --shapes "${SHAPES:?SHAPES=shape,...}" >"$OUT/sites/$label-r$round.log" 2>&1) \
      || echo "sites: $label round $round exited $? (log: sites/$label-r$round.log)"
  done
done
first=${variants[0]%%=*}
for v in "${variants[@]:1}"; do
  label=${v%%=*}
  echo "## $label / $first" >>"$OUT/sites.md"
  python3 "$R/benchmarks/ab_compare.py" "$OUT/sites/$first" "$OUT/sites/$label" --out "$OUT/sites-$label.md" >/dev/null
  cat "$OUT/sites-$label.md" >>"$OUT/sites.md"; echo >>"$OUT/sites.md"
  grep -h '^| [a-z0-9]' "$OUT/sites-$label.md" | sed "s/| bfloat16 //; s/^/$label /"
done
