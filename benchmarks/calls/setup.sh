# Sourced by the session's call scripts from the repository root: the carried bundles of
# .scratch/q2 unpacked into .scratch (sites.tar.xz: the prebuilt packages, each only where it is
# missing; site_r.tar.xz: main + the key-split patch), the wheels into .whl/ and, through a stage
# of h200.sh that does nothing, into /tmp/site (each h200.sh run gets a folder of its own: past 8
# files it archives its OUT); PYTHONPATH=/tmp/site. Fails the call when a bundle is missing.
unpack() {  # unpack BUNDLE SITE: BUNDLE's sites unless SITE is there already
  [[ -d .scratch/$2 ]] || python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall('.scratch')" "$1"
}
unpack .scratch/q2/sites.tar.xz site_new || exit 1
unpack .scratch/q2/site_r.tar.xz site_r || exit 1
mkdir -p .whl && cp .scratch/q2/whl/*.whl .whl/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$OUT/setup PREBUILT=.scratch/site_new TOTAL_S=60 CMD=true bash benchmarks/h200.sh cmd >/dev/null 2>&1
export PYTHONPATH=/tmp/site
