#!/bin/sh
# Run the Python package's tests (python/tests) against the build's
# libgcalloc.so with the first python3 that has pytest (Debian's
# python3-pytest; scripts/install-deps.sh installs it). Exit 77 (CTest's
# skip) where none has, unless GCALLOC_REQUIRE_PYTEST=1 (scripts/test.sh
# sets it, so CI fails instead).
# usage: run_pytest.sh LIBGCALLOC SOURCE_DIR [PYTEST ARGUMENTS]
# (default: every test under python/tests)
lib=$1 src=$2
shift 2
[ $# -eq 0 ] && set -- "$src/python/tests"
for py in python3 /usr/bin/python3; do
  if "$py" -c "import pytest" 2>/dev/null; then
    GCALLOC_LIBRARY=$lib PYTHONPATH=$src/python exec "$py" -m pytest -q -p no:cacheprovider "$@"
  fi
done
if [ "$GCALLOC_REQUIRE_PYTEST" = 1 ]; then
  echo "FAIL: no python3 with pytest (scripts/install-deps.sh installs python3-pytest)"
  exit 1
fi
echo "SKIP: no python3 with pytest"
exit 77
