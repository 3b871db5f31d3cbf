#!/usr/bin/env bash
# Nsight Compute on one warm launch of a kernel, for several prebuilt packages (benchmarks/
# prebuild.sh) or switches side by side: where one build spends its time that the other does not.
# Run from the repository root on the device:
#   VARIANTS="base=.scratch/site_base head=.scratch/site_new" SHAPES=d128-skewed \
#     NCU_REGEX=regex:fwd_sm90 bash benchmarks/ncu_sites.sh
# VARIANTS as in ab_sites.sh (LABEL=SITE[@VAR=VALUE,...]); SHAPES and NCU_CASE_ARGS go to
# ncu_case.py (which runs each shape twice: --launch-skip 1 profiles the warm launch of the first
# shape). Per variant: $OUT/ncu/LABEL.ncu-rep (--set full, source counters: warp-stall samples
# per SASS instruction), LABEL-details.txt (every section) and LABEL-sass.csv (the source page:
# per instruction, executed counts and stall samples; read it with ncu_sass_ledger.py). Prints
# the headline metrics of each variant.
set -uo pipefail
R=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ncu"
read -r -a variants <<<"${VARIANTS:?VARIANTS=\"label=site[@VAR=VALUE] ...\"}"
for v in "${variants[@]}"; do
  label=${v%%=*}; rest=${v#*=}; site=${rest%%@*}; envs=(); [[ $rest == *@* ]] && IFS=, read -r -a envs <<<"${rest#*@}"
  rep="$OUT/ncu/$label"
  (cd /tmp && env "${envs[@]}" PYTHONPATH="$R/$site${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout "${NCU_VARIANT_S:-150}" ncu --clock-control none --target-processes all -k "${NCU_REGEX:-regex:fwd_sm90}" \
    --launch-skip "${NCU_SKIP:-1}" --launch-count 1 --set full --import-source no -f -o "$rep" \
    python3 "$R/benchmarks/ncu_case.py" ${NCU_CASE_ARGS:-} ${SHAPES:?SHAPES=shape ...}) >"$rep.log" 2>&1 \
    || { echo "ncu: $label exited $? (log: ncu/$label.log)"; tail -5 "$rep.log"; continue; }
  ncu --import "$rep.ncu-rep" --page details >"$rep-details.txt" 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass >"$rep-sass.csv" 2>&1 \
    || echo "ncu: $label: no source page (see $label-sass.csv)"
  echo "== $label"
  grep -E "^  [A-Za-z0-9_]+|Duration|Executed Ipc Active|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Local Memory Spill|No Eligible|Stall" \
    "$rep-details.txt" | grep -v "^  *-" | head -24
done
