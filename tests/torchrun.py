"""Run a script's ranks on CPU (gloo) as torchrun starts them, and collect what each rank saved.

The ranks are started here, with the environment torchrun gives its workers, and meet at a
TCPStore that this process holds, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE): no
launcher process that imports torch, no rendezvous, and no wait for the agent to shut down
(about 2 s of CPU and 5 s of wall time a run, docs/test-suite.md)."""

import json
import os
import subprocess
import sys
import tempfile

import torch
from runtime import environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, nproc: int, out_dir, *args, timeout: int = 300, runtime_only: bool = False) -> list:
    """Run tests/<script> on nproc ranks. The script gets out_dir and args, and saves rank r's
    result to out_dir/rank{r}.pt; returns those results in rank order. runtime_only: with
    the runtime requirements alone (tests/runtime.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if runtime_only:
        env = environment(out_dir, env)
    cmd = [os.path.join(ROOT, "tests", script), str(out_dir), *map(str, args)]
    failed, output = run_ranks(cmd, env, nproc, timeout, preloaded=not runtime_only)
    assert not failed, f"{failed}:\n{output[-8000:]}"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(nproc)]


def output_of(script: str, *args: str, env: dict, nproc: int = 1, timeout: int = 600) -> str:
    """What `python script *args` prints (script: a path), in nproc processes at once forked
    from this process's preloaded zygote (torch imported), each with env; asserts that none
    failed."""
    failed, output = run_ranks([script, *args], env, nproc, timeout)
    assert not failed, output[-3000:]
    return output


def run_ranks(cmd: list, env: dict, nproc: int, timeout: int, preloaded: bool = True) -> tuple[str, str]:
    """Run nproc ranks of `python *cmd` with env (conftest's guard replaces this in the quick
    tier), forked by a tests/rank_zygote.py: preloaded, this process's, which has imported torch
    and the ranks' modules; otherwise one started with env for this run alone, which imports
    nothing (env may allow the runtime requirements alone). Where a rank fails or time runs
    out, the others are stopped: a rank left waiting in a collective would wait for ever.
    Returns what went wrong ("" when nothing did) and the ranks' output, one after the other."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    shared = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                  LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    with tempfile.TemporaryDirectory() as logs:
        paths = [os.path.join(logs, f"rank{r}.log") for r in range(nproc)]
        request = {"script": cmd[0], "args": cmd[1:], "logs": paths, "timeout": timeout,
                   "envs": [dict(shared, RANK=str(r), LOCAL_RANK=str(r)) for r in range(nproc)]}
        if preloaded:
            failed = ask(preloaded_zygote(), request)
        else:
            zygote = start_zygote(env, preload=False)
            failed = ask(zygote, request)
            zygote.stdin.close()
            zygote.wait()
        return failed, "".join(f"--- rank {r}\n{read(path)}" for r, path in enumerate(paths))


def start_zygote(env: dict, preload: bool) -> subprocess.Popen:
    """A tests/rank_zygote.py; it exits when its stdin closes (with this process at the latest)."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "rank_zygote.py"),
                             *(["--preload"] if preload else [])],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


_zygote = None


def preloaded_zygote() -> subprocess.Popen:
    """This process's zygote that has imported torch and the ranks' modules, started on first use."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = start_zygote(dict(os.environ, PYTHONPATH=ROOT), preload=True)
    return _zygote


def ask(zygote: subprocess.Popen, request: dict) -> str:
    """Have zygote run request's ranks; what went wrong ("" when nothing did)."""
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    answer = zygote.stdout.readline()
    if not answer:
        raise RuntimeError(f"tests/rank_zygote.py exited with {zygote.wait()}")
    return json.loads(answer)["failed"]


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
