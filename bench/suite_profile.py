"""Where `make test`'s time goes: the suite as `make test` runs it (two pytest-xdist workers),
with each test's wall time by module and the machine's CPU time by the kind of process that
spent it (pytest's workers, torchrun's ranks and launchers, TorchServe, the C++ compiler),
read from /proc every half second:

    python bench/suite_profile.py [--cold] [--out FILE] [pytest arguments, e.g. tests/test_tp.py]

--cold: inductor's cache in an empty folder, as a fresh clone's first run has it. Prints the
tables (markdown), and writes them to --out: CPU by kind of process; each module's wall time;
the CPU of the processes started in each test's own folder (its TorchServe, its ranks where
they run there), and each test's CPU inside its pytest worker. The tables of runs are in
docs/test-suite.md.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HZ = os.sysconf("SC_CLK_TCK")
KINDS = [  # (kind, what its command line holds), the first that matches
    ("C++ compiler", ("cc1plus", "g++ ", "c++ ", "collect2", "ninja ")),
    ("TorchServe's frontend (Java)", ("java",)),
    ("inductor's compile workers", ("compile_worker",)),
    ("TorchServe's workers (torchrun's ranks)", ("model_service_worker",)),
    ("torchrun launcher (the tests' and TorchServe's)", ("torch.distributed.run",)),
    ("test ranks (tests/*_worker.py, forked from tests/rank_zygote.py)", ("_worker.py", "rank_zygote.py")),
    ("pytest worker (in-process tests)", ("exec(eval(sys.stdin.readline()))", "pytest")),
]


def kind(cmdline: str) -> str:
    for name, marks in KINDS:
        if any(mark in cmdline for mark in marks):
            return name
    words = cmdline.split()
    return "other: " + " ".join(os.path.basename(w) for w in words[:2]) if words else "other"


def processes() -> dict:
    """{(pid, start time): (cpu seconds, command line, test folder)} of every process now (the
    process's name where its command line is that alone, as for TorchServe's workers; the test
    folder, or None: its TMPDIR's where that is a test's, else its working folder's)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, fields = f.read().split("(", 1)[1].rsplit(")", 1)
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read().replace("\0", " ").strip()
            with open(f"/proc/{pid}/environ", "rb") as f:  # a test server's TMPDIR is its folder
                tmpdir = next((v[7:] for v in f.read().split(b"\0") if v.startswith(b"TMPDIR=")), b"").decode()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        fields = fields.split()
        found[pid, fields[19]] = ((int(fields[11]) + int(fields[12])) / HZ, cmdline if " " in cmdline else name,
                                  test_folder(tmpdir) or test_folder(cwd))
    return found


def test_folder(path: str) -> str | None:
    """The test folder (the part of tmp_path under the worker's: a test's or a fixture's name)
    that path is in, or None outside pytest's temporary folders."""
    parts = path.split(os.sep)
    at = next((i for i, part in enumerate(parts) if part.startswith("popen-gw")), None)
    return None if at is None or at + 1 >= len(parts) else parts[at + 1]


def sample_cpu(done: threading.Event) -> tuple[collections.Counter, collections.Counter]:
    """CPU seconds by kind, and by test folder, spent while done is unset (a process seen at
    the start counts from there)."""
    start = processes()
    last = dict(start)
    while not done.wait(0.5):
        for key, (cpu, cmdline, folder) in processes().items():  # as first seen: an exiting process's is empty
            last[key] = (cpu, *last.get(key, (cpu, cmdline, folder))[1:])
    by_kind, by_folder = collections.Counter(), collections.Counter()
    for key, (cpu, cmdline, folder) in last.items():
        spent = cpu - start.get(key, (0.0,))[0]
        by_kind[kind(cmdline)] += spent
        if folder and "pytest" not in cmdline:
            by_folder[folder] += spent
    return by_kind, by_folder


# --- the pytest plugin (-p bench.suite_profile; bench/ itself is not on the path: its modules'
# names are the product's): one line per test phase

def pytest_runtest_logreport(report):
    if "PYTEST_XDIST_WORKER" in os.environ and (out := os.environ.get("SUITE_PROFILE_OUT")):
        with open(out, "a") as f:
            f.write(json.dumps({"test": report.nodeid.split("@")[0], "seconds": report.duration, "ended": time.time(),
                                "worker": os.environ["PYTEST_XDIST_WORKER"]}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """The CPU time of the worker's own process (every thread) over the test's set-up, call
    and tear-down: a module's fixtures count in its first test."""
    cpu = time.process_time()
    yield
    if "PYTEST_XDIST_WORKER" in os.environ and (out := os.environ.get("SUITE_PROFILE_OUT")):
        with open(out, "a") as f:
            f.write(json.dumps({"test": item.nodeid.split("@")[0], "cpu": time.process_time() - cpu}) + "\n")


def run(pytest_args: list[str], cold: bool) -> tuple:
    """(wall time, wall s by module, CPU s by kind, CPU s by test folder, in-process CPU s by
    test, pytest's summary, each worker's last test's end)"""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SUITE_PROFILE_OUT=os.path.join(tmp, "tests.jsonl"))
        if cold:
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        done = threading.Event()
        cpu = {}
        sampler = threading.Thread(target=lambda: cpu.update(spent=sample_cpu(done)))
        sampler.start()
        start, wall_start = time.perf_counter(), time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                               "-p", "bench.suite_profile", *(pytest_args or ["-m", "not combinations", "tests"])],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        by_module, in_process, ended = collections.Counter(), collections.Counter(), {}
        if os.path.exists(env["SUITE_PROFILE_OUT"]):
            for line in open(env["SUITE_PROFILE_OUT"]):
                row = json.loads(line)
                if "cpu" in row:
                    in_process[row["test"]] += row["cpu"]
                    continue
                by_module[row["test"].split("::")[0]] += row["seconds"]
                ended[row["worker"]] = max(ended.get(row["worker"], 0.0), row["ended"] - wall_start)
    out = proc.stdout.strip().splitlines()
    # pytest's last line, after the tests that failed and the slowest (with --durations)
    summary = "\n".join(line for line in out if line.startswith("FAILED") or " call " in line
                        or " setup " in line) + "\n" + out[-1] if out else proc.stderr[-500:]
    return wall, by_module, *cpu["spent"], in_process, summary, ended


def tables(wall: float, by_module: collections.Counter, by_kind: collections.Counter, by_folder: collections.Counter,
           in_process: collections.Counter, ended: dict, top: int = 20) -> str:
    cpu = sum(by_kind.values())
    lines = [f"Wall time {wall:.0f} s; CPU time {cpu:.0f} s ({cpu / wall / os.cpu_count():.0%} of "
             f"{os.cpu_count()} cores). Each worker's last test ended at: "
             + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(ended.items())) + ".",
             "", "| kind of process | CPU s | share |", "|---|---|---|"]
    rows = [(k, v) for k, v in by_kind.most_common() if v >= cpu / 200]
    rows.append(("everything else (kernel threads, shells, each under 0.5 %)", cpu - sum(v for _, v in rows)))
    lines += [f"| {k} | {v:.0f} | {v / cpu:.0%} |" for k, v in rows]
    total = sum(by_module.values())
    lines += ["", f"| module (top {top}) | its tests' wall s, both workers | share |", "|---|---|---|"]
    lines += [f"| {m} | {v:.0f} | {v / total:.0%} |" for m, v in by_module.most_common(top)]
    lines += ["", f"| test folder (top {top}): its TorchServe, its ranks, its subprocesses | CPU s |", "|---|---|"]
    lines += [f"| {m} | {v:.0f} |" for m, v in by_folder.most_common(top)]
    lines += ["", f"| test (top {top}), in its pytest worker, fixtures included | CPU s |", "|---|---|"]
    lines += [f"| {m} | {v:.1f} |" for m, v in in_process.most_common(top)]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="inductor's cache in an empty folder")
    ap.add_argument("--out", help="also write the tables here")
    a, pytest_args = ap.parse_known_args()
    wall, by_module, by_kind, by_folder, in_process, summary, ended = run(pytest_args, a.cold)
    text = f"{summary}\n\n{tables(wall, by_module, by_kind, by_folder, in_process, ended)}\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
