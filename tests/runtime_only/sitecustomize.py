"""Imported at start-up by every Python whose PYTHONPATH has this folder (tests/runtime.py
puts it there): it makes the Python one with the runtime requirements alone, however many
test packages the venv holds. The path finder no longer finds a top-level module in a
site-packages folder unless the JSON file that $LLAMA_RUNTIME_MODULES names lists it, as if
it were not installed; the standard library, this repository's modules and the folders a
package puts on sys.path itself (setuptools' _vendor) stay."""

import json
import os
import sys
from importlib.machinery import PathFinder


class RuntimeOnly:
    def __init__(self, allowed: set[str]):
        self.allowed = allowed

    def find_spec(self, name, path=None, target=None):
        if path is None and name not in self.allowed:  # a top-level module: not in site-packages
            path = [p for p in sys.path if os.path.basename(os.path.normpath(p)) != "site-packages"]
        return PathFinder.find_spec(name, path, target)

    def invalidate_caches(self):
        PathFinder.invalidate_caches()

    def find_distributions(self, *args, **kwargs):  # importlib.metadata (llguidance reads its version)
        return PathFinder.find_distributions(*args, **kwargs)


if os.environ.get("LLAMA_RUNTIME_MODULES"):
    with open(os.environ["LLAMA_RUNTIME_MODULES"]) as f:
        runtime_only = RuntimeOnly(set(json.load(f)))
    sys.meta_path = [runtime_only if finder is PathFinder else finder for finder in sys.meta_path]
