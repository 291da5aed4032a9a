"""g++ for one of inductor's kernels, as the tests build them (tests/g++-O1 runs this for
commands that define C10_USING_CUSTOM_GENERATED_MACROS, which only inductor's have):

    python -S tests/compile_kernel.py ARGS...   (g++'s arguments)

- At -O1 instead of -O3: the same numbers in less g++ time. Inductor's flags allow no
  reassociation nor contraction (-fno-unsafe-math-optimizations, -ffp-contract=off), so the
  kernels compute the same numbers, only slower, which the tests' few steps of tiny models do
  not feel.
- Once for every source that differs from one built before only in the numbers of the local
  buffer names inductor writes (`out_ptr16` in one graph, `out_ptr39` in the next: the same
  FlexAttention kernel, 2.3 s of g++ each here, for a row and for several rows, for each
  QUANT). A library built from one source (one .cpp to one .so) is kept in inductor's cache
  folder under the hash of its command and its source with those names numbered in order
  of appearance, and copied for each later source with the same hash.
"""

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys

LOCAL_NAMES = re.compile(r"\bout_ptr\d+\b")


def renamed(code: str) -> str:
    """code with its local buffer names numbered in order of first appearance: the same text for
    sources that differ only in those numbers, another for any other difference."""
    names: dict[str, str] = {}
    return LOCAL_NAMES.sub(lambda m: names.setdefault(m[0], f"out_ptr{len(names)}"), code)


def build(args: list[str]) -> int:
    args = ["-O1" if arg == "-O3" else arg for arg in args]
    sources = [arg for arg in args if arg.endswith(".cpp")]
    out = args[args.index("-o") + 1] if "-o" in args[:-1] else ""
    if len(sources) != 1 or not out.endswith(".so"):
        return subprocess.call(["g++", *args])
    with open(sources[0], encoding="utf-8") as f:
        code = renamed(f.read())
    command = [arg for arg in args if arg not in (sources[0], out)]
    key = hashlib.sha256("\0".join([code, *command]).encode()).hexdigest()
    # beside inductor's own cache (the library's folder's folder): emptied with it
    kept = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(out))), "renamed_kernels", f"{key}.so")
    os.makedirs(os.path.dirname(kept), exist_ok=True)
    # one build of a source at a time: inductor builds a graph's kernels at once, and a graph
    # of two layers has two FlexAttention kernels alike
    with open(f"{kept}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(kept):
            copy(kept, out)
            return 0
        status = subprocess.call(["g++", *args])
        if status == 0:
            copy(out, kept)
    return status


def copy(source: str, target: str):
    """source's bytes in a new file under target's name, once whole: a process that loaded the
    library there before keeps its own (writing over it in place changes a mapped library)."""
    part = f"{target}.{os.getpid()}"
    shutil.copy(source, part)
    os.replace(part, target)


if __name__ == "__main__":
    sys.exit(build(sys.argv[1:]))
