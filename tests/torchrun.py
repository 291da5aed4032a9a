"""Run a script under torchrun on CPU (gloo) and collect what each rank saved."""

import os
import subprocess
import sys

import torch
from runtime import environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, nproc: int, out_dir, *args, timeout: int = 300, runtime_only: bool = False) -> list:
    """Run tests/<script> on nproc ranks (--standalone picks a free rendezvous port).
    The script gets out_dir and args, and saves rank r's result to out_dir/rank{r}.pt;
    returns those results in rank order. runtime_only: with the runtime requirements
    alone (tests/runtime.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if runtime_only:
        env = environment(out_dir, env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "tests", script), str(out_dir), *map(str, args)]
    proc = run_ranks(cmd, env, timeout)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(nproc)]


def run_ranks(cmd: list, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """The torchrun process (conftest's guard replaces this in the quick tier)."""
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
