#!/usr/bin/env python3
"""The layout's rules, checked (label `layout`; docs/design.md states them):

1. Layers depend one way. Every `#include "..."` of a source file is resolved
   to the folder it names, and a folder may include only the folders listed
   for it below: a lower layer never includes a higher one's header, and a
   backend sees only the backend interface and the base utilities.
2. Layers call one way too: every call of a gca_ function in a source file
   is resolved to the file that defines it, and the caller's folder must
   be allowed to include that file's folder (a call into src/backends is
   allowed where any of its headers is): no call up a layer. Above the
   library (replay, tools, bench), the public API is allowed, and a gca__
   function only where a header the folder may include declares it: the
   toolkit reaches the library's insides through src/core/inspect.h, the
   simulator's driver API and the base utilities, never otherwise.
3. A gca__ function of the library that only the toolkit calls is part of
   an interface made for it (declared in src/core/inspect.h or the sim's
   driver API) or one of the few base operations listed in TOOLKIT_ONLY;
   anything else the toolkit alone needs belongs in the toolkit.
4. With BUILD given: every global symbol the static library defines has the
   gca_ prefix family (nm), and the shared library links no compression
   library (its own NEEDED entries, objdump -p: Debian's libunwind itself
   links liblzma, which ldd then lists too).

usage: check_layout.py SOURCE_DIR [BUILD_DIR]
"""
import os
import re
import subprocess
import sys

# Folder -> the folders its files may include (besides include/gcalloc.h).
ALLOWED = {
    "src/base": {"src/base"},
    "src/backends": {"src/base", "src/backends"},
    "src/core": {"src/base", "src/backends/backend.h", "src/core"},
    "src/host": {"src/base", "src/backends/backend.h", "src/core", "src/host"},
    "src/observe": {"src/base", "src/backends/backend.h", "src/core", "src/observe"},
    "src/api": {"src/base", "src/backends/backend.h", "src/core", "src/host", "src/observe", "src/api"},
    "replay": {"src/base", "src/core/inspect.h", "src/backends/sim_driver.h", "replay"},
    "tools": {"src/base", "src/core/inspect.h", "src/backends/sim_driver.h", "replay", "tools"},
    "bench": {"src/base", "src/core/inspect.h", "src/backends/sim_driver.h", "replay", "tools", "bench"},
}
# Base operations only the toolkit calls, kept with the structure they
# belong to (rule 3), and why.
TOOLKIT_ONLY = {
    "gca__addr_map_del": "the integer map's delete, beside its insert and lookup",
    "gca__arena_extend": "the arena's grow in place, which needs the arena's chunks",
    "gca__helper_detach": "the helper threads' job nobody waits for, which needs their queue",
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# Headers the build generates (in the build folder), each as the source it
# is made from: they belong to that source's folder.
GENERATED = {"report_page.h": "tools/report_page.js"}


def resolve(src, here, name):
    """The include's path relative to src, as the compiler finds it (the
    file's own folder first, then src/, the project root, include/; a
    generated header, its source)."""
    if name in GENERATED and os.path.isfile(os.path.join(src, GENERATED[name])):
        return GENERATED[name]
    for base in (here, os.path.join(src, "src"), src, os.path.join(src, "include")):
        path = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(path):
            return os.path.relpath(path, src)
    return None


def layer_of(rel):
    for folder in sorted(ALLOWED, key=len, reverse=True):
        if rel == folder or rel.startswith(folder + "/"):
            return folder
    return None


def allowed(rules, rel):
    return rel == "include/gcalloc.h" or any(rel == r or rel.startswith(r + "/") for r in rules)


def check_includes(src):
    problems, seen = [], 0
    for folder in ALLOWED:
        for root, _, files in os.walk(os.path.join(src, folder)):
            for f in files:
                if not f.endswith((".c", ".h")):
                    continue
                path = os.path.join(root, f)
                rel_file = os.path.relpath(path, src)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                for name in INCLUDE.findall(text):
                    seen += 1
                    rel = resolve(src, root, name)
                    if rel is None:
                        problems.append("%s: #include \"%s\" is not a file of the project" % (rel_file, name))
                    elif not allowed(ALLOWED[layer_of(rel_file)], rel):
                        problems.append("%s (layer %s) includes %s (layer %s)" %
                                        (rel_file, layer_of(rel_file), rel, layer_of(rel) or "?"))
    return problems, seen


DEFINITION_LINE = re.compile(r"^[A-Za-z_][\w \t\*]*?\b(gca_\w+)\s*\((.*)$", re.M)
CALL = re.compile(r"\b(gca_\w+)\s*\(")
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"", re.S)


def definitions(text):
    """The gca_ functions a file defines (a line at column 0 naming one, not
    a prototype: one that ends with ';' and opens no body)."""
    for m in DEFINITION_LINE.finditer(text):
        rest = m.group(2)
        if "{" in rest or not rest.rstrip().endswith(";"):
            yield m


def source_files(src):
    for folder in ALLOWED:
        for root, _, files in os.walk(os.path.join(src, folder)):
            for f in sorted(files):
                if f.endswith(".c"):
                    path = os.path.join(root, f)
                    with open(path, encoding="utf-8") as fh:
                        yield os.path.relpath(path, src), COMMENT.sub(" ", fh.read())


def declarations(src):
    """The gca__ functions each header of src/ declares."""
    out = {}
    for root, _, files in os.walk(os.path.join(src, "src")):
        for f in files:
            if f.endswith(".h"):
                path = os.path.join(root, f)
                with open(path, encoding="utf-8") as fh:
                    text = COMMENT.sub(" ", fh.read())
                out[os.path.relpath(path, src)] = set(re.findall(r"\b(gca__\w+)\s*\(", text))
    return out


def may_call(caller, rules, name, callee, declared):
    """Inside the library, a folder may call into a file it may include, or
    into any file of src/backends where it may include one of that folder's
    headers; the public calls are the front end's, so a lower layer calling
    one calls up. Above it (replay, tools, bench), the public API, and a
    gca__ function of the library only where a header it may include
    declares it."""
    if not caller.startswith("src/"):
        if not callee.startswith("src/"):
            return allowed(rules, callee)
        if not name.startswith("gca__"):
            return True
        return any(name in names and allowed(rules, header) for header, names in declared.items())
    if allowed(rules, callee):
        return True
    return callee.startswith("src/backends/") and any(r.startswith("src/backends/") for r in rules)


def check_calls(src):
    files = dict(source_files(src))
    defined = {}
    for rel, text in files.items():
        for m in definitions(text):
            defined.setdefault(m.group(1), rel)
    declared = declarations(src)
    problems, seen = [], 0
    in_library, above = set(), {}
    for rel, text in files.items():
        own = {m.start(1) for m in definitions(text)}
        rules = ALLOWED[layer_of(rel)]
        for m in CALL.finditer(text):
            callee = defined.get(m.group(1))
            if m.start(1) in own or callee is None:
                continue
            if rel.startswith("src/"):
                in_library.add(m.group(1))
            else:
                above.setdefault(m.group(1), set()).add(rel)
            if callee == rel:
                continue
            seen += 1
            if not may_call(rel, rules, m.group(1), callee, declared):
                problems.append("%s (layer %s) calls %s of %s (layer %s)" %
                                (rel, layer_of(rel), m.group(1), callee, layer_of(callee)))
    interfaces = declared.get("src/core/inspect.h", set()) | declared.get("src/backends/sim_driver.h", set())
    for name in sorted(above):
        callee = defined[name]
        if (callee.startswith("src/") and name.startswith("gca__") and name not in in_library and
                name not in interfaces and name not in TOOLKIT_ONLY):
            problems.append("%s (of %s) is called only above the library (%s): it belongs in the toolkit, "
                            "or in src/core/inspect.h if it must see the core" %
                            (name, callee, ", ".join(sorted(above[name]))))
    return sorted(set(problems)), seen


def check_build(build):
    problems = []
    static = os.path.join(build, "libgcalloc.a")
    out = subprocess.run(["nm", "-g", "--defined-only", static], capture_output=True, text=True, check=True).stdout
    symbols = [line.split()[2] for line in out.splitlines() if len(line.split()) == 3]
    for name in symbols:
        # (AddressSanitizer adds an ODR indicator named after each global.)
        if name.startswith("__odr_asan."):
            name = name[len("__odr_asan."):]
        if not name.startswith("gca_"):
            problems.append("libgcalloc.a defines %s: every global symbol has the gca_ prefix family" % name)
    shared = os.path.join(build, "libgcalloc.so")
    dump = subprocess.run(["objdump", "-p", shared], capture_output=True, text=True, check=True).stdout
    needed = " ".join(line.split()[1] for line in dump.splitlines() if line.strip().startswith("NEEDED"))
    for lib in ("libz.", "libzstd.", "liblzma.", "libbz2."):
        if lib in needed:
            problems.append("libgcalloc.so links %s: decompression belongs to the replay toolkit" % lib.rstrip("."))
    return problems, len(symbols)


def main():
    src = os.path.abspath(sys.argv[1])
    problems, seen = check_includes(src)
    print("layers: %d includes checked" % seen)
    more, calls = check_calls(src)
    problems += more
    print("layers: %d calls across files checked" % calls)
    if len(sys.argv) > 2:
        more, count = check_build(os.path.abspath(sys.argv[2]))
        problems += more
        print("symbols: %d global symbols of libgcalloc.a checked; libgcalloc.so's NEEDED libraries checked" % count)
    for p in problems:
        print("FAIL: " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
