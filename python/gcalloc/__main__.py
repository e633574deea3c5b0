"""`python -m gcalloc ARGS` (and the `gcalloc` command a pip install makes)
runs the gcalloc tool: the one installed inside the package, else the first
`gcalloc` on PATH that is not this script."""
import os
import sys


def tool_path():
    """The gcalloc tool's path, or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    bundled = os.path.join(here, "bin", "gcalloc")
    if os.access(bundled, os.X_OK):
        return bundled
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder, "gcalloc")
        if os.access(candidate, os.X_OK) and os.path.realpath(candidate) != me and _is_binary(candidate):
            return candidate
    return None


def _is_binary(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    tool = tool_path()
    if tool is None:
        sys.stderr.write("gcalloc: the gcalloc tool is not installed with this package (pip install . from the "
                         "repository installs it; a CMake build makes build/gcalloc)\n")
        return 127
    sys.stdout.flush()
    os.execv(tool, [tool] + args)


if __name__ == "__main__":
    sys.exit(main())
