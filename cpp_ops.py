"""Building our C++ ops (block_quant.cpp, race.cpp) on first use with torch.utils.cpp_extension:
once per source, flags, compiler, CPU (-march=native) and ninja, cached across processes in
TORCH_EXTENSIONS_DIR, whose lock file lets one process build while the others wait."""

import functools
import hashlib
import os
import shutil
import subprocess

CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: at::parallel_for is inline, OpenMP pragmas (torch's libgomp at run time)


def build(source: str, what: str, cflags: list[str] = CFLAGS) -> str:
    """Builds source (a path) and loads it (its ops, if it registers any, into torch.ops);
    returns the library's path. ValueError naming what (the code's use) when the machine lacks
    what building takes."""
    from torch.utils.cpp_extension import is_ninja_available, load

    name = os.path.basename(source)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise ValueError(f"{what} ({name}): built on first use, which needs a C++ compiler: {compiler!r} is not "
                         "on PATH (install g++, or set CXX)")
    if not is_ninja_available():
        raise ValueError(f"{what} ({name}): built on first use, which needs ninja: pip install ninja==1.13.2 "
                         "(requirements.txt)")
    with open(source, "rb") as f:
        code = f.read()
    # a name per source, compiler, CPU and ninja: builds of other versions (other checkouts), by
    # another compiler, from another machine sharing the cache, or by another ninja never
    # overwrite nor stand in for this one
    digest = hashlib.sha256(code + repr(cflags).encode() + compiler.encode() + cpu_flags()
                            + ninja_version()).hexdigest()[:12]
    name = f"{name.removesuffix('.cpp')}_{digest}"
    return load(name=name, sources=[source_copy(code, name)], extra_cflags=cflags, is_python_module=False)


def source_copy(code: bytes, name: str) -> str:
    """The path of a copy of code named after its build: ninja's command holds the source's
    path, so a build from another path (another checkout, each folder TorchServe unpacks a
    model archive into) compiled the library again (1.3 s for race.cpp, 7 s for
    block_quant.cpp here), and the next build from the first path again."""
    from torch.utils.cpp_extension import get_default_build_root

    folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), "sources")
    path = os.path.join(folder, f"{name}.cpp")
    if not os.path.exists(path):  # written whole, under its final name only once complete
        os.makedirs(folder, exist_ok=True)
        part = f"{path}.{os.getpid()}"
        with open(part, "wb") as f:
            f.write(code)
        os.replace(part, path)
    return path


@functools.cache
def ninja_version() -> bytes:
    """The version of the ninja on PATH, which torch builds with. Ninja's log keys each output
    by a hash of its command that versions compute otherwise (1.11 against 1.13), so processes
    finding other ninjas (the venv's, under make, and the system's) compiled again in turn in
    one folder: race.cpp 16 times in one run of the suite."""
    return subprocess.run(["ninja", "--version"], capture_output=True, check=True).stdout


def cpu_flags() -> bytes:
    """The instruction sets /proc/cpuinfo lists (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
