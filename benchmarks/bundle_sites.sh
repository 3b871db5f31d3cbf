#!/usr/bin/env bash
# Prebuild several commits (each optionally with a pending patch) for the device and pack them
# into one xz bundle to carry (benchmarks/README.md, "One device call"): the packages that
# ab_sites.sh, ncu_sites.sh and h200.sh's PREBUILT / AB_BASE_SITE take. From the repository root:
#   bash benchmarks/bundle_sites.sh .scratch/q2/sites.tar.xz base=7d8a538 new=HEAD \
#     split=HEAD+benchmarks/pending/fwd-key-split-experiment.patch
# Each NAME=COMMIT[+PATCH] becomes .scratch/site_NAME (unpacked on the device into .scratch/ by
# `python3 -c "import tarfile; tarfile.open(BUNDLE).extractall('.scratch')"`). A site already
# built from the same sources and patch (.scratch/site_NAME/SPEC) is reused. The patch is applied with
# `patch -p1` inside the exported tree (`git apply` run inside .scratch/ would apply nothing, and
# say nothing). ~5 min of 2 cores per build (benchmarks/prebuild.sh; PATH must give a Python
# with nanobind, nvidia-cutlass and jax).
set -euo pipefail
bundle=${1:?usage: bundle_sites.sh BUNDLE.tar.xz NAME=COMMIT[+PATCH] ...}; shift
root=$(pwd); names=()
for spec in "$@"; do
  name=${spec%%=*}; rev=${spec#*=}; commit=${rev%%+*}; patch=""; [[ $rev == *+* ]] && patch=${rev#*+}
  # The build's inputs: the commit's source, build files and Python package (not its docs), and the patch.
  src=$(git ls-tree "$commit" ffi jax_varlen cmake CMakeLists.txt pyproject.toml | sha1sum | cut -c1-12)
  site=.scratch/site_$name; id="$(git rev-parse --short "$commit") sources $src${patch:+ + $(sha1sum <"$patch" | cut -c1-12)}"
  names+=("site_$name")
  if [[ -f $site/SPEC && $(cut -d' ' -f2- "$site/SPEC") == "${id#* }" ]]; then echo "$name: reused ($id)"; continue; fi
  tree=.scratch/tree_$name; build=/tmp/prebuild-site_$name  # a fresh build folder: CMake's cache names its source
  rm -rf "$tree" "$site" "$build"; mkdir -p "$tree"
  git archive "$commit" | tar -x -C "$tree"
  [[ -z $patch ]] || (cd "$tree" && patch -p1 -s <"$root/$patch")
  t0=$(date +%s)
  bash benchmarks/prebuild.sh "$tree" "$site" "$build" >"$build.out" || { cat "$build.out"; exit 1; }
  echo "$id" >"$site/SPEC"
  echo "$name: built $id in $(($(date +%s) - t0)) s"
done
mkdir -p "$(dirname "$bundle")"
tar -C .scratch -cf - "${names[@]}" | xz -T2 -6 >"$bundle"
echo "$bundle: $(du -h "$bundle" | cut -f1) (${names[*]})"
