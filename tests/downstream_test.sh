#!/usr/bin/env bash
# Installs loom from the build tree into a fresh prefix, then builds and runs
# examples/downstream against it as a separate CMake project would.
set -euo pipefail
build_dir=$1 src_dir=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/loom/loomConfig.cmake"
test -f "$work/prefix/include/loom/loom.h"
torch_prefix=$("$src_dir/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
cmake -S "$src_dir/examples/downstream" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" "${launcher[@]}" > "$work/configure.log"
cmake --build "$work/build" -j 2
"$work/build/downstream" "$work/run"
