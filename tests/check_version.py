#!/usr/bin/env python3
"""One version everywhere (label `layout`): CMake's project version, set in
CMakeLists.txt and nowhere else, is what gca_version() returns (through the
Python package too), what `gcalloc version` prints, the header's macros, the
shared library's file name and soname, the pkg-config file, the CMake
package's version file and CHANGELOG.md's newest heading; and `gcalloc
version --help` prints help, not the version.

usage: check_version.py SOURCE_DIR BUILD_DIR VERSION
"""
import ctypes
import os
import re
import subprocess
import sys


def main():
    src, build, version = sys.argv[1], sys.argv[2], sys.argv[3]
    major, minor, patch = version.split(".")
    problems = []

    def same(what, value):
        if value != version:
            problems.append("%s says %r, CMake %r" % (what, value, version))

    lib = ctypes.CDLL(os.path.join(build, "libgcalloc.so"))
    lib.gca_version.restype = ctypes.c_char_p
    same("gca_version()", lib.gca_version().decode())
    env = dict(os.environ, GCALLOC_LIBRARY=os.path.join(build, "libgcalloc.so"),
               PYTHONPATH=os.path.join(src, "python"))
    out = subprocess.run([sys.executable, "-c", "import gcalloc; print(gcalloc.version())"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    same("gcalloc.version() in Python", out)
    tool = os.path.join(build, "gcalloc")
    if os.path.exists(tool):
        out = subprocess.run([tool, "version"], capture_output=True, text=True, check=True).stdout.strip()
        same("gcalloc version", out.replace("gcalloc ", "", 1))
        out = subprocess.run([tool, "version", "--help"], capture_output=True, text=True, check=True).stdout
        if not out.startswith("usage: gcalloc version\n"):
            problems.append("gcalloc version --help prints %r, not its usage" % out[:60])
    with open(os.path.join(build, "include", "gcalloc_version.h")) as f:
        header = f.read()
    macros = dict(re.findall(r"#define GCALLOC_VERSION_(\w+) (\S+)", header))
    same("gcalloc_version.h", "%s.%s.%s" % (macros["MAJOR"], macros["MINOR"], macros["PATCH"]))
    same("GCALLOC_VERSION_STRING", macros["STRING"].strip('"'))
    with open(os.path.join(src, "include", "gcalloc.h")) as f:
        if re.search(r"#define GCALLOC_VERSION_(MAJOR|MINOR|PATCH|STRING)\b", f.read()):
            problems.append("include/gcalloc.h defines a version of its own")
    real = os.path.realpath(os.path.join(build, "libgcalloc.so"))
    same("libgcalloc.so's file", os.path.basename(real).replace("libgcalloc.so.", "", 1))
    dump = subprocess.run(["objdump", "-p", real], capture_output=True, text=True, check=True).stdout
    soname = re.search(r"SONAME\s+(\S+)", dump).group(1)
    want = "libgcalloc.so.%s" % (major + "." + minor if major == "0" else major)
    if soname != want:
        problems.append("the soname is %s, not %s" % (soname, want))
    with open(os.path.join(build, "gcalloc.pc")) as f:
        same("gcalloc.pc", re.search(r"^Version: (\S+)", f.read(), re.M).group(1))
    with open(os.path.join(build, "gcallocConfigVersion.cmake")) as f:
        same("gcallocConfigVersion.cmake", re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', f.read()).group(1))
    with open(os.path.join(src, "CHANGELOG.md")) as f:
        same("CHANGELOG.md's newest heading", re.search(r"^## (\S+)", f.read(), re.M).group(1))
    for p in problems:
        print("FAIL: " + p)
    print("version %s: %d places checked" % (version, 11))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
