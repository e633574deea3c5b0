#!/usr/bin/env bash
# The test command: install what is needed, then build and run the whole
# suite four ways, failing at the first failure:
#   gcc, warnings as errors, built with profile-guided optimization as
#   scripts/run.sh builds (scripts/build-pgo.sh)   all tests
#   clang, warnings as errors          all tests
#   gcc, AddressSanitizer + UBSan      all tests
#   clang, ThreadSanitizer             the concurrent tests, the Ascend backend and
#                                      the hostile-use tests (labels `threads`,
#                                      `acl`, `hardening`)
# Pass a CTest label (-L core) to run only that label in every build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

jobs=$(nproc)
# The report's render test skips where Chromium is missing, the Python
# package's where pytest is; here both were installed above, so a missing
# one is a failure.
export GCALLOC_REQUIRE_CHROMIUM=1
export GCALLOC_REQUIRE_PYTEST=1
ctest_args=("$@")
unset PGO # (set per build below, never from the caller's environment)

run() { # name, ctest label filter or "", cmake options... (PGO=1: built by scripts/build-pgo.sh)
  local name=$1 label=$2
  shift 2
  echo "=== $name ==="
  if [ "${PGO:-0}" = 1 ]; then
    scripts/build-pgo.sh "build-$name" -DGCALLOC_WERROR=ON "$@"
  else
    cmake -S . -B "build-$name" -DGCALLOC_WERROR=ON "$@" >/dev/null
    cmake --build "build-$name" -j"$jobs" >/dev/null
  fi
  local filter=()
  [ -n "$label" ] && filter=(-L "$label")
  (cd "build-$name" && ctest --output-on-failure -j"$jobs" "${filter[@]}" "${ctest_args[@]}")
}

PGO=1 run gcc-pgo "" -DCMAKE_BUILD_TYPE=RelWithDebInfo
run clang "" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 \
  run asan "" -DCMAKE_C_COMPILER=gcc -DCMAKE_CXX_COMPILER=g++ -DCMAKE_BUILD_TYPE=Debug "-DGCALLOC_SANITIZE=address;undefined"
# ThreadSanitizer needs the address-space layout it was built for: run
# without address randomization where the kernel's mmap entropy is too high.
TSAN_OPTIONS=halt_on_error=1 setarch "$(uname -m)" -R bash -c "$(declare -f run); jobs=$jobs; ctest_args=(${ctest_args[*]@Q}); run tsan 'threads|acl|hardening|frameworks' -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGCALLOC_SANITIZE=thread"
echo "=== all builds passed ==="
