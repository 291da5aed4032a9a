"""A Python with the runtime requirements alone, inside the test venv: the top-level modules
of requirements.txt's packages and what they require (their markers evaluated, no extras),
and of pip and setuptools (every venv has them); sitecustomize.py lets the standard library
and this repository's modules in too.
environment() gives the variables that make a subprocess refuse every other module
(tests/runtime_only/sitecustomize.py), so a shipped module that needs a test package (numpy
through transformers, say) fails there as on a user's machine after `make serve`."""

import importlib.metadata as metadata
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_DEFAULTS = ["pip", "setuptools"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(requirements: str) -> list[str]:
    """The package names a requirements file pins, following its -r includes."""
    names = []
    with open(requirements) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line.startswith("-r"):
                names += pinned(os.path.join(os.path.dirname(requirements), line[2:].strip()))
            elif line:
                names.append(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0])
    return names


def closure(names: list[str]) -> set[str]:
    """The installed distributions names need, themselves included."""
    from packaging.requirements import Requirement

    seen, todo = set(), [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.distribution(name).requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return seen


def runtime_modules() -> list[str]:
    dists = closure(pinned(os.path.join(ROOT, "requirements.txt")) + VENV_DEFAULTS)
    modules = {top for top, owners in metadata.packages_distributions().items()
               if any(canonical(d) in dists for d in owners)}
    return sorted(modules | set(sys.builtin_module_names))


def environment(tmp_dir, env: dict | None = None) -> dict:
    """env (os.environ by default) for a subprocess with the runtime requirements alone."""
    env = dict(os.environ if env is None else env)
    os.makedirs(tmp_dir, exist_ok=True)
    listing = os.path.join(str(tmp_dir), "runtime_modules.json")
    with open(listing, "w") as f:
        json.dump(runtime_modules(), f)
    paths = [os.path.join(ROOT, "tests", "runtime_only"), ROOT] + [p for p in [env.get("PYTHONPATH")] if p]
    return env | {"LLAMA_RUNTIME_MODULES": listing, "PYTHONPATH": os.pathsep.join(paths)}
