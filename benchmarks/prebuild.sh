#!/usr/bin/env bash
# Build a source tree for the device here, so that a device call spends none of its time on the
# build (~125 s a tree on the device): the extension for sm_90a and the device's Python (3.12),
# with the package's Python files and pip's record beside it, in a folder that h200.sh
# takes as PREBUILT (this tree) or AB_BASE_SITE (the ab stage's base). Usage:
#   bash benchmarks/prebuild.sh SOURCE_TREE OUT_SITE [BUILD_DIR]
# Env: PY_DEVICE, a Python of the device's minor version (default: pyenv's 3.12); PY_HOST, the
# Python whose packages give nanobind, CUTLASS (nvidia-cutlass) and the XLA FFI headers (jaxlib)
# (default: python3 on PATH). Neither needs network; CMAKE_DEFINES: more -D flags for the
# configure (e.g. "-DJAX_VARLEN_FWD_TRACE=ON", a profiling build). ~5 min of 2 cores per tree.
set -euo pipefail
src=$(cd "$1" && pwd); out=$2; build=${3:-/tmp/prebuild-$(basename "$out")}
PY_DEVICE=${PY_DEVICE:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 | head -1)}
PY_HOST=${PY_HOST:-python3}
shim=$(mktemp -d)
# The device Python imports nanobind and cutlass_library (pure Python) from the host's packages
# and asks a stand-in jax for the FFI headers' folder (CMakeLists.txt asks `jax.ffi.include_dir()`;
# jaxlib itself is built for the host's Python).
read -r nb cl inc < <("$PY_HOST" -c "import os, nanobind, cutlass_library, jax
print(os.path.dirname(nanobind.__file__), os.path.dirname(cutlass_library.__file__), jax.ffi.include_dir())")
ln -s "$nb" "$shim/nanobind"; ln -s "$cl" "$shim/cutlass_library"; mkdir "$shim/jax"
printf 'class ffi:\n    @staticmethod\n    def include_dir():\n        return %s\n' "'$inc'" >"$shim/jax/__init__.py"
PYTHONPATH=$shim cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PY_DEVICE" -DJAX_VARLEN_CUDA=ON -DJAX_VARLEN_CUDA_ARCHS=90a-real ${CMAKE_DEFINES:-} >"$build.log" 2>&1 \
  || { tail -20 "$build.log"; exit 1; }
# Without CUTLASS the build leaves the Hopper path out, silently: useless on the device.
grep -q "Hopper (sm_90a) path" "$build.log" || { echo "prebuild: no Hopper path (nvidia-cutlass?)"; tail -5 "$build.log"; exit 1; }
PYTHONPATH=$shim cmake --build "$build" >>"$build.log" 2>&1 || { tail -30 "$build.log"; exit 1; }
rm -rf "$out"; mkdir -p "$out"
cp -r "$src/jax_varlen" "$out/"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
cp "$build"/_jax_varlen*.so "$out/jax_varlen/"
strip --strip-unneeded "$out"/jax_varlen/_jax_varlen*.so
# pip's record of the package: a source checkout run from the repository root (`python -m
# pytest`) finds the compiled extension through it (jax_varlen/_ffi.py, _use_installed_extension).
version=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$src/pyproject.toml" | head -1)
info="$out/jax_varlen-$version.dist-info"; mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: jax_varlen\nVersion: %s\n' "$version" >"$info/METADATA"
(cd "$out" && find jax_varlen -type f | sort | sed 's/$/,,/'; echo "${info#$out/}/METADATA,,"; echo "${info#$out/}/RECORD,,") >"$info/RECORD"
rm -rf "$shim"
du -sh "$out" | cut -f1
