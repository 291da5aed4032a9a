"""What the benchmarks share: the machine they ran on, their sections of BENCHMARKS.md, fresh
processes to measure in, and the rounds' arguments."""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCHMARKS.md")


def checkout(commit: str, into: str) -> str:
    """The repository's files at commit, in a folder of their own (a baseline to compare with)."""
    os.makedirs(into)
    archive = subprocess.run(["git", "archive", commit], cwd=os.path.dirname(BENCHMARKS), capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / (1 << 20)
    return (f"{m[1].strip() if m else 'unknown CPU'}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
            f"Linux {platform.release()}")


def header() -> str:
    """When and where a benchmark ran: the date, the machine, torch's version."""
    import torch

    return f"{datetime.date.today().isoformat()}, {machine()}, torch {torch.__version__}"


def publish(name: str, text: str, write: bool = True):
    """Print a benchmark's section and, unless told not to, put it into BENCHMARKS.md."""
    print(text)
    if write:
        write_section(name, text)
        print(f"wrote the {name} section of {BENCHMARKS}", file=sys.stderr)


def write_section(name: str, text: str):
    """Replace BENCHMARKS.md's section between <!-- name:start --> and <!-- name:end -->
    (append it when missing); the rest of the file stays as it is."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    doc = open(BENCHMARKS).read() if os.path.isfile(BENCHMARKS) else "# Benchmarks\n"
    block = f"{start}\n{text.strip()}\n{end}"
    if start in doc and end in doc:
        head, rest = doc.split(start, 1)
        doc = head + block + rest.split(end, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    with open(BENCHMARKS, "w") as f:
        f.write(doc)


def fresh_process(code: str, *args: str) -> dict:
    """What python -c code args prints last, as JSON: a measurement in a process of its own,
    on one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


class LoadedProcess:
    """python -c script args, which loads what it measures, prints "ready", then answers each
    line it reads with one line: a tree's process that several measurements take turns with."""

    def __init__(self, script: str, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().strip() == "ready", f"{args} failed to load"

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def alternating_calls(procs: dict, calls: int, lines: list[str]) -> dict:
    """{line: {name: [answer of each call]}}: each line asked of each LoadedProcess in turn, calls
    times, the order of the processes alternating (pairs of calls meet the same machine); the
    processes are closed after."""
    answers = {line: {name: [] for name in procs} for line in lines}
    for call in range(calls):
        for line in lines:
            for name in list(procs)[::1 if call % 2 == 0 else -1]:
                answers[line][name].append(procs[name].ask(line))
    for proc in procs.values():
        proc.close()
    return answers


def rounds_arguments(doc: str) -> argparse.Namespace:
    """--rounds (fresh processes per setting, alternating) and --no-write (print only)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args()


def ab_arguments(doc: str, baseline: str, rounds: int, calls: int) -> argparse.Namespace:
    """--baseline (earlier commits to compare with), --rounds, --calls (each tree's timed calls a
    round) and --no-write (print only), for the benches of this tree against earlier commits."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", nargs="+", default=[baseline])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--calls", type=int, default=calls)
    ap.add_argument("--no-write", action="store_true")
    return ap.parse_args()
