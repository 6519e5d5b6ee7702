#!/usr/bin/env bash
# make demo: the project's main job. Until the trainer lands this is the single-process
# example trained with the public API.
set -euo pipefail
build=${1:-build}
cmake --install "$build" > /dev/null
prefix=$(grep -E '^CMAKE_INSTALL_PREFIX:' "$build/CMakeCache.txt" | cut -d= -f2)
cmake -S examples -B "$build/examples" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
cmake --build "$build/examples" > /dev/null
"$build/examples/tiny_regression"
