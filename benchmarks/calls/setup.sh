# Sourced by the session's call scripts from the repository root: the carried bundles of
# .scratch/q2 unpacked into .scratch (site_NAME.tar.xz holds the prebuilt package
# .scratch/site_NAME, unpacked only where it is missing: site_new = HEAD's kernels, site_r = main +
# the key-split patch), the wheels into .whl/ and, through a stage of h200.sh that does nothing,
# into /tmp/site (each h200.sh run gets a folder of its own: past 8 files it archives its OUT);
# PYTHONPATH=/tmp/site; serve_ab (below). Fails the call when a bundle is missing.
unpack() {  # unpack BUNDLE SITE: BUNDLE's sites unless SITE is there already
  [[ -d .scratch/$2 ]] || python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall('.scratch')" "$1"
}
unpack .scratch/q2/site_new.tar.xz site_new || exit 1
unpack .scratch/q2/site_r.tar.xz site_r || exit 1
mkdir -p .whl && cp .scratch/q2/whl/*.whl .whl/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$OUT/setup PREBUILT=.scratch/site_new TOTAL_S=60 CMD=true bash benchmarks/h200.sh cmd >/dev/null 2>&1
export PYTHONPATH=/tmp/site
# mixed-serve's forward on HEAD's kernels, the mixed order and the mixed order with key-split
# units (site_r), one process each: serve_ab BUDGET_S.
serve_ab() {
  OUT=$OUT/serve VARIANTS="head=.scratch/site_new mixed=.scratch/site_r@JAX_VARLEN_FWD_MIXED_ORDER=1 \
split=.scratch/site_r@JAX_VARLEN_FWD_MIXED_ORDER=1,JAX_VARLEN_FWD_KEY_SPLIT=1" SHAPES=mixed-serve PASSES=fwd \
    ROUNDS=1 STEP_S=4 BUDGET_S=$1 bash benchmarks/ab_sites.sh
}
