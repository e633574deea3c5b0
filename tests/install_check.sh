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
# The Python package lands where the system's python3 searches under the
# configured prefix (for /usr/local on Debian, a folder on its own path:
# it does not search /usr/local/lib/python3/dist-packages), and imports from
# there.
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
pydir=$(cache GCALLOC_PYTHON_DIR) py=$(cache GCALLOC_PYTHON3) prefix=$(cache CMAKE_INSTALL_PREFIX)
if [ -n "$pydir" ] && [ -x "$py" ]; then
  test -f "$scratch/prefix/$pydir/gcalloc/__init__.py"
  if "$py" -c 'import os, sys; sys.exit(os.path.isdir("/usr/lib/python3/dist-packages") == False)'; then
    # (Debian's python3: the configured prefix's folder must be on its path.)
    "$py" -c 'import sys; p = sys.argv[1]; sys.exit(0 if p in sys.path else "%s does not search %s" % (sys.executable, p))' \
      "$prefix/$pydir"
  fi
  GCALLOC_LIBRARY=$(ls "$libdir"/libgcalloc.so.*.* | head -n 1) PYTHONPATH="$scratch/prefix/$pydir" \
    "$py" -c 'import gcalloc; assert gcalloc.version()'
fi
echo "install check: headers, shared and static libraries, pkg-config, CMake package and Python package all work"
