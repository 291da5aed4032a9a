"""A private TorchServe for tests and benchmarks: its own ports (free ones, so that it never meets a
running `make serve`), its own pid file and key file, the repository's configs otherwise."""

import collections
import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import psutil
import requests
import yaml

import build_mar
import configure
import wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


# below Linux's ephemeral range (32768-60999), which the clients' own connections draw from: a
# port taken from it could be some connection's local port by the time torchrun binds it.
# LOCAL_SERVER_PORTS=FIRST-LAST narrows it, so that processes starting servers at once (the
# tests' pytest-xdist workers: tests/conftest.py) never pick the same port.
FIRST_PORT, LAST_PORT = map(int, os.environ.get("LOCAL_SERVER_PORTS", "20000-32767").split("-"))
PORTS = range(FIRST_PORT, LAST_PORT + 1)
# its own generator: lm_eval's simple_evaluate seeds the global one (test_lm_eval.py), after which
# every run of the suite drew the same ports, until /tmp/.ts.sock files that earlier runs left
# blocked all 100 tries of a server's worker ports
PICK = random.Random()


def free_port(taken: set = frozenset()) -> int:
    """A free port, not one of taken (chosen for the same server, not bound yet)."""
    for _ in range(1000):
        port = PICK.choice(PORTS)
        if port not in taken and port_free(port):
            return port
    raise RuntimeError("no free port")


def free_port_range(n: int, taken: set = frozenset()) -> int:
    """A base port b with b..b+n-1 free and not taken, for the ranks' worker sockets."""
    reasons = collections.Counter()
    for _ in range(100):
        base = free_port(taken)
        why = "past the range" if base + n >= PORTS.stop else next(
            filter(None, (blocked(base + i, taken) for i in range(n))), None)
        if why is None:
            return base
        reasons[why] += 1
    raise RuntimeError(f"no free range of {n} ports in {PORTS.start}-{PORTS.stop - 1}: {dict(reasons)}")


def blocked(port: int, taken: set) -> str | None:
    """Why port cannot be a worker's port (taken, bound, or a socket file left there), or None."""
    if port in taken:
        return "taken"
    if not port_free(port):
        return "bound"
    if os.path.exists(f"/tmp/.ts.sock.{port}"):
        return "a socket file left"
    return None


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def share_precompiled_headers(tmp: str):
    """Makes tmp, a server's $TMPDIR, whose torchinductor_$USER/precompiled_headers (where
    inductor keeps them, whatever TORCHINDUCTOR_CACHE_DIR says) is this process's: each server
    that compiled built its own (147 MB, 4 s of g++)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    cache = default_cache_dir()
    shared, name = os.path.join(cache, "precompiled_headers"), os.path.basename(cache)
    os.makedirs(shared, exist_ok=True)
    os.makedirs(os.path.join(tmp, name), exist_ok=True)
    link = os.path.join(tmp, name, "precompiled_headers")
    if not os.path.lexists(link):
        os.symlink(shared, link)


class Server:
    """A private TorchServe's folder: free ports in its own config.properties, its own pid
    file ($TMPDIR) and key file. build() then start(), or make_serve(), start it."""

    def __init__(self, workdir: str, tp: int = 2, env: dict | None = None):
        self.workdir, self.tp = workdir, tp
        self.tmp = os.path.join(workdir, "tmp")  # TorchServe's pid file goes to $TMPDIR
        share_precompiled_headers(self.tmp)
        self.extra_env = env or {}  # for the frontend and the workers it starts
        names = ("inference", "management", "metrics", "grpc", "grpc_management")
        taken = set()  # free ports drawn one at a time may repeat: the frontend's second bind then fails
        for name in names:
            taken.add(free_port(taken))
        self.ports = dict(zip(names, sorted(taken)))
        self.worker_port = free_port_range(tp + 1, taken)
        self.taken = taken | set(range(self.worker_port, self.worker_port + tp + 1))
        self.url = f"http://127.0.0.1:{self.ports['inference']}"
        self.grpc_target = f"127.0.0.1:{self.ports['grpc']}"
        self.metrics_url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        self.write_properties()

    def build(self, weights: str, batch_size: int = 4, handler: dict | None = None,
              model_config: dict | None = None, root: str = ROOT, threads: int | None = None,
              handler_file: str | None = None, modules: tuple = ()) -> "Server":
        """This folder's model-config.yaml and llama.mar (weights: a checkpoint folder packed
        into the archive, or None when handler.checkpoint is absolute), from the handler and
        model-config.yaml of root (another checkout: a benchmark's baseline); handler_file
        and modules: another handler that builds on root's (tools/build_mar.py)."""
        with open(os.path.join(root, "model-config.yaml")) as f:
            config = configure.configure(yaml.safe_load(f), tp=self.tp, device="cpu", rdzv_port=free_port(self.taken),
                                         batch_size=batch_size, handler=handler, threads=threads)
        config.update(model_config or {})
        self.config = config
        config_path = os.path.join(self.workdir, "model-config.yaml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        self.model_store = os.path.join(self.workdir, "model_store")
        build_mar.build_mar(config_path, self.model_store, weights, root=root, handler=handler_file, modules=modules)
        return self

    def write_properties(self):
        with open(os.path.join(ROOT, "config.properties")) as f:
            text = f.read()
        p = self.ports
        for key, value in {"inference_address": f"http://127.0.0.1:{p['inference']}",
                           "management_address": f"http://127.0.0.1:{p['management']}",
                           "metrics_address": f"http://127.0.0.1:{p['metrics']}",
                           "grpc_inference_port": p["grpc"], "grpc_management_port": p["grpc_management"],
                           "metrics_config": os.path.join(ROOT, "metrics.yaml")}.items():
            text, n = re.subn(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
            assert n == 1, key
        text += f"initial_worker_port={self.worker_port}\ninitial_distribution_port={self.worker_port}\n"
        with open(os.path.join(self.workdir, "config.properties"), "w") as f:
            f.write(text)

    @property
    def env(self) -> dict:
        return dict(os.environ, TMPDIR=self.tmp, PATH=BIN + os.pathsep + os.environ["PATH"]) | self.extra_env

    def start(self, timeout: float = 300):
        with open(os.path.join(self.workdir, "torchserve.out"), "w") as out:
            subprocess.run([os.path.join(BIN, "torchserve"), "--start", "--ncs", "--ts-config", "config.properties",
                            "--model-store", self.model_store, "--models", "llama=llama.mar"],
                           cwd=self.workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT, check=True)
        self.key = wait_ready.wait(self.url, os.path.join(self.workdir, "key_file.json"), timeout,
                                   os.path.join(self.workdir, "logs"))
        return self

    def make_serve(self, *variables: str, settings: tuple = (), timeout: float = 600) -> tuple[int, str, float]:
        """(exit status, output, seconds) of `make serve` run here: RUN, TS_CONFIG and TMPDIR
        are this folder's and the ranks meet on a free port. variables: more NAME=VALUE for
        make; settings: more KEY=VALUE for model-config.yaml (make's SET)."""
        settings = ("deviceType=cpu", f"torchrun.rdzv-endpoint=127.0.0.1:{free_port()}", *settings)
        cmd = ["make", "--no-print-directory", "-C", ROOT, "serve", f"RUN={self.workdir}", f"TP={self.tp}",
               f"TS_CONFIG={os.path.join(self.workdir, 'config.properties')}", f"SET={' '.join(settings)}",
               *variables]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        self.key = wait_ready.inference_key(os.path.join(self.workdir, "key_file.json"))
        return done.returncode, done.stdout, time.perf_counter() - start

    def stop(self, wait: bool = True):
        """Stop TorchServe and wait until its processes are gone (killed after 30 s); wait=False:
        on a thread of its own, which wait_for_stops() joins (a server's processes take 3-10 s
        to end, with nothing left for its tests to see), killing what is left."""
        if not wait:
            stopping = threading.Thread(target=self.stop, name=f"stop {self.workdir}")
            stopping.start()
            STOPPING.append(stopping)
            return
        java = self.frontend()
        try:  # before --stop: the frontend may be gone by the time it returns
            procs = ([java] + java.children(recursive=True)) if java else []
        except psutil.NoSuchProcess:
            procs = []
        subprocess.run([os.path.join(BIN, "torchserve"), "--stop"], cwd=self.workdir, env=self.env,
                       capture_output=True)
        deadline = time.monotonic() + 30
        while procs and time.monotonic() < deadline and not HURRY.is_set():
            _, procs = psutil.wait_procs(procs, timeout=0.2)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def frontend(self) -> psutil.Process | None:
        pid_file = os.path.join(self.tmp, ".model_server.pid")
        try:
            with open(pid_file) as f:
                return psutil.Process(int(f.read()))
        except (OSError, ValueError, psutil.Error):
            return None

    def worker_pids(self) -> set[int]:
        """The pids of the rank processes (model_service_worker.py) of this server."""
        java = self.frontend()
        return {p.pid for p in java.children(recursive=True)
                if any("model_service_worker.py" in part for part in p.cmdline())
                and not any("torchrun" in part for part in p.cmdline())} if java else set()

    def log(self, name: str = "model_log.log") -> str:
        with open(os.path.join(self.workdir, "logs", name), errors="replace") as f:
            return f.read()

    def logged(self, text: str, timeout: float = 10) -> bool:
        """Whether the workers' log has text within timeout seconds: the frontend writes what
        a worker prints on a thread of its own, and may answer the request first."""
        deadline = time.time() + timeout
        while text not in self.log():
            if time.time() > deadline:
                return False
            time.sleep(0.05)
        return True

    # --- requests ---------------------------------------------------------------------

    def headers(self, key: str | None = "default") -> dict:
        key = self.key if key == "default" else key
        return {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})

    def post(self, body, path: str = "", stream: bool = False, key="default", headers: dict | None = None,
             **kwargs) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(f"{self.url}/predictions/llama{path}", data=data,
                             headers=self.headers(key) | (headers or {}), stream=stream, timeout=120, **kwargs)

    def generate(self, body) -> dict:
        r = self.post(body)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, body) -> list[dict]:
        """The JSON lines of a streamed answer, as they arrive."""
        r = self.post(body | {"stream": True}, stream=True)
        assert r.status_code == 200, r.text
        return [json.loads(line) for line in r.iter_lines() if line]


STOPPING: list[threading.Thread] = []
HURRY = threading.Event()  # wait_for_stops(): the stopping servers' processes are killed


def wait_for_stops():
    """Join the stops begun with wait=False, killing their servers' processes rather than
    waiting the 4 s or so that TorchServe takes to end them (at the end of a test run, its
    last seconds)."""
    HURRY.set()
    while STOPPING:
        STOPPING.pop().join()
    HURRY.clear()


def start_server(workdir, weights, tp: int = 2, env: dict | None = None, timeout: float = 300, **build) -> Server:
    server = Server(str(workdir), tp, env)
    try:
        return server.build(weights, **build).start(timeout)
    except BaseException:
        if os.path.exists(os.path.join(server.workdir, "torchserve.out")):
            print(open(os.path.join(server.workdir, "torchserve.out")).read()[-3000:])
        if os.path.exists(os.path.join(server.workdir, "logs", "model_log.log")):
            print(server.log()[-5000:])
        server.stop()
        shutil.rmtree(server.tmp, ignore_errors=True)
        raise
