#!/bin/sh
# `pip install .` as a user runs it: the source tree installed into a fresh
# virtual environment of Debian's python3, offline (PIP_NO_INDEX: nothing
# may be downloaded), then checked from the installed package alone, with
# no PYTHONPATH, GCALLOC_LIBRARY or LD_LIBRARY_PATH: the package imports its
# own libgcalloc.so, `gcalloc` and `python -m gcalloc` run the bundled tool
# on the bundled samples, and the Python package's tests pass against it.
# The environment sees the system's packages only for pytest. Exit 77
# (CTest's skip) where python3 has no venv module or no pytest, unless
# GCALLOC_REQUIRE_PYTEST=1 (scripts/test.sh sets it, so CI fails instead).
# usage: check_pip_install.sh SOURCE_DIR WORK_DIR [PYTEST ARGUMENTS]
set -u
src=$1 work=$2
shift 2
py=/usr/bin/python3
[ -x "$py" ] || py=python3
if ! "$py" -c "import venv, ensurepip, pytest" 2>/dev/null; then
  if [ "${GCALLOC_REQUIRE_PYTEST:-}" = 1 ]; then
    echo "FAIL: $py has no venv, ensurepip or pytest (scripts/install-deps.sh installs python3-venv and python3-pytest)"
    exit 1
  fi
  echo "SKIP: $py has no venv, ensurepip or pytest"
  exit 77
fi
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work" || fail "cannot make $work"
"$py" -m venv --system-site-packages "$work/env" || fail "python3 -m venv failed"
env=$work/env
unset PYTHONPATH GCALLOC_LIBRARY LD_LIBRARY_PATH
PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$env/bin/pip" install --quiet "$src" || fail "pip install $src failed"
cd "$work" || fail "cannot enter $work"
"$env/bin/python" - "$env" <<'PY' || fail "the installed package is not the one imported"
import os, sys
import gcalloc
env = os.path.realpath(sys.argv[1])
for what, path in (("the package", gcalloc.__file__), ("its library", gcalloc.library_path)):
    if not os.path.realpath(path).startswith(env + os.sep):
        sys.exit("%s comes from %s, not from the environment %s" % (what, path, env))
print("imported", gcalloc.__file__, "with", gcalloc.library_path, "version", gcalloc.version())
PY
want=$("$env/bin/python" -c "import gcalloc; print(gcalloc.version())")
for cmd in "$env/bin/gcalloc" "$env/bin/python -m gcalloc"; do
  got=$($cmd version) || fail "'$cmd version' failed"
  [ "$got" = "gcalloc $want" ] || fail "'$cmd version' printed '$got', not 'gcalloc $want'"
done
"$env/bin/gcalloc" replay "$(ls -d "$env"/lib/python3*/site-packages/gcalloc/data/snapshots/training)/memory.pickle" \
  >replay.out || fail "the bundled tool cannot replay the bundled training sample"
grep -q "gcalloc / PyTorch = 1.000" replay.out || fail "the replay of the bundled sample did not match PyTorch's peak"
[ $# -eq 0 ] && set -- "$src/python/tests"
exec "$env/bin/python" -m pytest -q -p no:cacheprovider "$@"
