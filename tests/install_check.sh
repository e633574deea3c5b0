#!/usr/bin/env bash
# Install the build into a scratch prefix, then build and run a consumer
# three ways: pkg-config (shared), the CMake package's shared target, and
# its static target. Usage: install_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
libdir=$(ls -d "$scratch"/prefix/lib*/ | head -n 1)
test -f "$scratch/prefix/include/gcalloc.h"
ls "$libdir"/libgcalloc.so* "$libdir"/libgcalloc.a >/dev/null

export PKG_CONFIG_PATH="$libdir/pkgconfig"
cc -o "$scratch/via_pkgconfig" "$src/tests/consumer/consumer.c" $(pkg-config --cflags --libs gcalloc)
LD_LIBRARY_PATH="$libdir" "$scratch/via_pkgconfig"

cmake -S "$src/tests/consumer" -B "$scratch/consumer" -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
cmake --build "$scratch/consumer" >/dev/null
LD_LIBRARY_PATH="$libdir" "$scratch/consumer/consumer_shared"
"$scratch/consumer/consumer_static"
echo "install check: headers, shared and static libraries, pkg-config and CMake package all work"
