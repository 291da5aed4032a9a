"""Every module the archive ships runs with requirements.txt alone: `make serve` installs
nothing more, while `make test` adds the test packages (numpy among them, through
transformers), which would hide a shipped module's need of one. tests/runtime.py makes
a subprocess refuse every package outside the runtime requirements' closure; the TP=2
handler test (test_handler_tp.py) and the TorchServe servers of the suite run that way too."""

import glob
import os
import subprocess
import sys
import pytest

from runtime import ROOT, environment

SHIPPED = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))  # tools/build_mar.py
SERVE_TOOLS = ["configure", "build_mar", "wait_ready"]  # what `make serve` runs besides


def run_runtime_only(tmp_path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=environment(tmp_path), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # subprocesses
def test_a_test_package_is_refused(tmp_path):
    for module in ("jsonschema", "transformers", "openai"):  # installed here, by requirements-test.txt
        run = run_runtime_only(tmp_path, f"import {module}")
        assert run.returncode != 0 and f"No module named '{module}'" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow  # subprocesses
def test_every_shipped_module_imports_and_passes_rank_0s_batch(tmp_path):
    """The shipped modules and make serve's tools import; the batch broadcast (the handler's, at every iteration)
    and the set-up's gathers turn bytes into tensors and back, short and long, on a one-rank gloo group."""
    code = f"""
import importlib, sys
sys.path.append("tools")
for name in {SHIPPED + SERVE_TOOLS!r}:
    importlib.import_module(name)
import torch.distributed as dist
import collectives
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
for payload in (b"", b"a batch", bytes(range(256)) * 40):
    assert collectives.broadcast_bytes(payload, dist.group.WORLD) == payload
    assert collectives.all_gather_bytes(payload) == [payload]
dist.destroy_process_group()  # before exit: gloo's threads still running then aborted it once
print("served")
"""
    run = run_runtime_only(tmp_path, code)
    assert run.returncode == 0 and "served" in run.stdout, run.stderr[-3000:]
