"""The build backend of `pip install .` (PEP 517), kept in the repository.

pip builds a package in an isolated environment into which it installs the
backend named in pyproject.toml; setuptools, the usual one, would have to be
downloaded there. This backend needs nothing but Python's standard library
and CMake, so `pip install .` works offline, in any virtual environment,
with no flag. It builds libgcalloc and the `gcalloc` tool with CMake (a
Release build, no tests) and makes a wheel of the Python package with both
inside it: gcalloc/libgcalloc.so, gcalloc/bin/gcalloc, and the sample
snapshots in gcalloc/data/snapshots, where the package and the tool look
first. The version is the one CMakeLists.txt sets.

config_settings: "build-dir" keeps the CMake build there (default: a
temporary folder, removed after), "jobs" the parallel build jobs (default:
the processors).
"""
import base64
import hashlib
import io
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "gcalloc"
SUMMARY = "A caching allocator for GPU and NPU memory with PyTorch's semantics"
TAG = "py3-none-linux_%s" % os.uname().machine


def _version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        m = re.search(r"project\(\s*gcalloc\s+VERSION\s+([0-9.]+)", f.read())
    if not m:
        raise RuntimeError("gcalloc_build: no project(gcalloc VERSION ...) in CMakeLists.txt")
    return m.group(1)


def _metadata():
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: %s\nRequires-Python: >=3.8\n"
            "Description-Content-Type: text/markdown\n\n" % (NAME, _version(), SUMMARY))


def _dist_info():
    return "%s-%s.dist-info" % (NAME, _version())


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = os.path.join(metadata_directory, _dist_info())
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    return _dist_info()


def _cmake_build(build_dir, jobs):
    if shutil.which("cmake") is None:
        raise RuntimeError("gcalloc_build: cmake is not installed (scripts/install-deps.sh installs what "
                           "the build needs)")
    subprocess.run(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                    "-DGCALLOC_BUILD_TESTS=OFF", "-DGCALLOC_BUILD_TOOLS=ON"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir, "-j", str(jobs), "--target", "gcalloc", "gcalloc_tool"],
                   check=True, stdout=subprocess.DEVNULL)
    library = os.path.realpath(os.path.join(build_dir, "libgcalloc.so"))
    tool = os.path.join(build_dir, "gcalloc")
    for path in (library, tool):
        if not os.path.isfile(path):
            raise RuntimeError("gcalloc_build: the build made no %s" % path)
    return library, tool


def _files(library, tool):
    """(path in the wheel, path on disk, executable) of everything shipped."""
    out = []
    package = os.path.join(ROOT, "python", NAME)
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            out.append(("%s/%s" % (NAME, name), os.path.join(package, name), False))
    out.append(("%s/libgcalloc.so" % NAME, library, False))
    out.append(("%s/bin/gcalloc" % NAME, tool, True))
    samples = os.path.join(ROOT, "data", "snapshots")
    for folder in sorted(os.listdir(samples)) if os.path.isdir(samples) else []:
        snapshot = os.path.join(samples, folder, "memory.pickle")
        if os.path.isfile(snapshot):
            out.append(("%s/data/snapshots/%s/memory.pickle" % (NAME, folder), snapshot, False))
    return out


def _add(zf, record, arcname, data, executable=False):
    info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append("%s,sha256=%s,%d" % (arcname, digest, len(data)))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    settings = config_settings or {}
    jobs = settings.get("jobs") or os.cpu_count() or 2
    build_dir = settings.get("build-dir")
    temporary = None
    if not build_dir:
        temporary = build_dir = tempfile.mkdtemp(prefix="gcalloc-build-")
    try:
        library, tool = _cmake_build(os.path.abspath(build_dir), jobs)
        wheel = "%s-%s-%s.whl" % (NAME, _version(), TAG)
        info, record = _dist_info(), []
        with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as zf:
            for arcname, path, executable in _files(library, tool):
                with open(path, "rb") as f:
                    _add(zf, record, arcname, f.read(), executable)
            _add(zf, record, info + "/METADATA", _metadata().encode())
            _add(zf, record, info + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: gcalloc_build\n"
                                              "Root-Is-Purelib: false\nTag: %s\n" % TAG).encode())
            _add(zf, record, info + "/entry_points.txt",
                 b"[console_scripts]\ngcalloc = gcalloc.__main__:main\n")
            record.append(info + "/RECORD,,")
            zf.writestr(zipfile.ZipInfo(info + "/RECORD", date_time=(1980, 1, 1, 0, 0, 0)),
                        "\n".join(record) + "\n")
        return wheel
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)


def build_sdist(sdist_directory, config_settings=None):
    """The repository's tracked files (git ls-files), or without git every
    file but build folders and caches."""
    base = "%s-%s" % (NAME, _version())
    try:
        names = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], check=True, capture_output=True).stdout
        paths = [p for p in names.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith((".", "build")) and d != "__pycache__"]
            paths += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files]
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(paths):
            if os.path.isfile(os.path.join(ROOT, path)):
                tar.add(os.path.join(ROOT, path), arcname=base + "/" + path, recursive=False)
        pkg_info = _metadata().encode()
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return name
