#!/usr/bin/env bash
# Install what gcalloc needs to build, test and benchmark on Debian:
# a C toolchain (gcc and clang), CMake, cmocka (tests), libbsd (its
# header-only red-black tree), json-c (the JSON export), libunwind (stacks
# in the history), zlib, zstd, liblzma and libbz2 (the replay reads gzip-,
# zstd-, xz- and bzip2-compressed traces), python3 (a test reads the pickle export with Python's own
# unpickler), python3-pytest (the Python package's tests) and python3-venv (a test
# runs `pip install .` in a fresh virtual environment), the sanitizer runtimes and libFuzzer (clang's runtime), Chromium
# and a font (a test renders the replay's HTML report headless), and the peers
# the benchmark measures against (mimalloc, jemalloc) and valgrind (it counts a pair's instructions).
# Runs apt-get as root, or through sudo when
# available; does nothing when all is there already.
set -euo pipefail

packages=(build-essential cmake pkg-config clang libclang-rt-14-dev libcmocka-dev libbsd-dev
          libmimalloc2.0 libmimalloc-dev libjemalloc2 libjemalloc-dev libjson-c-dev libunwind-dev zlib1g-dev libzstd-dev liblzma-dev libbz2-dev
          python3 python3-pytest python3-venv valgrind
          chromium fonts-liberation)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null; then
  sudo=(sudo)
else
  echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
