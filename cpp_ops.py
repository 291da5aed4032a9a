"""Building our C++ ops (block_quant.cpp, race.cpp) on first use with torch.utils.cpp_extension:
once per source, flags and CPU (-march=native), cached across processes in TORCH_EXTENSIONS_DIR,
whose lock file lets one process build while the others wait."""

import hashlib
import os
import shutil

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
        # a name per source and CPU: builds of other versions (other checkouts), or from another
        # machine sharing the cache, never overwrite nor stand in for this one
        digest = hashlib.sha256(f.read() + repr(cflags).encode() + cpu_flags()).hexdigest()[:12]
    return load(name=f"{name.removesuffix('.cpp')}_{digest}", sources=[source], extra_cflags=cflags,
                is_python_module=False)


def cpu_flags() -> bytes:
    """The instruction sets /proc/cpuinfo lists (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
