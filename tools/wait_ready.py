"""Wait until TorchServe answers a generation request, then show how to call it. While the
model loads, show how far each rank has got, from the handler's 'loading rank=R/N: stage'
lines in TorchServe's logs; when a worker fails to load, stop waiting at once and print why
(which rank, which file): TorchServe would retry it forever.

    python tools/wait_ready.py --url http://127.0.0.1:8080 --key-file key_file.json --logs logs --examples
"""

import argparse
import datetime
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque

TIMESTAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d),\d+ ")  # log4j's, local time
STAGE = re.compile(r"loading rank=(\d+)/(\d+): ([^;]+?)(?:; (.*))?$")
LOAD_FAILED = "Load model failed"  # ts_log.log, whenever a worker dies while loading
STOPPED = "Torchserve stopped."  # ts_log.log: the frontend itself ended
SETTLE = 1.5  # s to wait after a failure for the other ranks' lines


class LoadFailed(RuntimeError):
    pass


def inference_key(key_file: str) -> str | None:
    try:
        with open(key_file) as f:
            return json.load(f)["inference"]["key"]
    except (OSError, ValueError, KeyError):
        return None


def post(url: str, body: dict, key: str | None, timeout: float = 120) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Tail:
    """The lines a growing file gained since the last call (none while it does not exist),
    from the first one stamped at or after since (a time.time(); None: all of them): TorchServe
    appends to the logs of earlier runs."""

    def __init__(self, path: str, since: float | None = None):
        self.path, self.offset, self.partial, self.since = path, 0, b"", since

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = self.partial + f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data) - len(self.partial)
        *lines, self.partial = data.split(b"\n")
        lines = [line.decode(errors="replace") for line in lines]
        if self.since is None:
            return lines
        for i, line in enumerate(lines):
            m = TIMESTAMP.match(line)
            if m and datetime.datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S").timestamp() >= self.since:
                self.since = None  # this run's lines from here on
                return lines[i:]
        return []


def message(line: str) -> str:
    """A model_log.log line without TorchServe's prefix (time, level, thread, MODEL_LOG)."""
    return line.split(" MODEL_LOG - ", 1)[-1]


class Loading:
    """What TorchServe's logs say about the model's loading so far."""

    def __init__(self, logs: str, since: float | None = None):
        self.model_log = Tail(os.path.join(logs, "model_log.log"), since)
        self.ts_log = Tail(os.path.join(logs, "ts_log.log"), since)
        self.logs = logs
        self.world = 0
        self.stages: dict[int, str] = {}  # the last stage of each rank
        self.read: dict[int, int] = {}  # bytes read by each rank
        self.errors: dict[int, str] = {}
        self.recent = deque(maxlen=200)  # the model log's last messages, for the traceback
        self.failed_at: float | None = None
        self.stopped = False

    def poll(self):
        """Read what the logs gained; yields each new stage, as 'rank R/N: stage (figures)'."""
        for line in self.model_log.lines():
            text = message(line)
            self.recent.append(text)
            m = STAGE.search(text)
            if m:
                yield self.record(int(m[1]), int(m[2]), m[3], m[4] or "")
        for line in self.ts_log.lines():
            if (LOAD_FAILED in line or STOPPED in line) and self.failed_at is None:
                self.failed_at = time.monotonic()
                self.stopped = STOPPED in line

    def record(self, rank: int, world: int, stage: str, rest: str) -> str:
        self.world = world
        self.stages[rank] = stage
        figures = dict(re.findall(r"(\w+)=(\S+)", rest))
        if "bytes" in figures and stage in ("reading checkpoint", "weights loaded"):
            self.read[rank] = int(figures["bytes"])
        if stage == "failed":
            self.errors[rank] = rest.partition("error=")[2]
            self.failed_at = self.failed_at or time.monotonic()
        return f"rank {rank}/{world}: {stage}" + (f" ({describe(figures)})" if figures and stage != "failed" else "")

    @property
    def failed(self) -> bool:
        return self.failed_at is not None and time.monotonic() - self.failed_at > SETTLE

    def status(self, elapsed: float) -> str:
        ready = sum(stage == "ready" for stage in self.stages.values())
        return (f"loading: {elapsed:.0f} s, {ready}/{self.world or '?'} ranks ready, "
                f"{sum(self.read.values()) / 1e9:.2f} GB read")

    def failure(self) -> str:
        """The failed ranks' errors and the last lines of the last traceback in the log."""
        if self.stopped:
            return f"TorchServe stopped while the model was loading (see {self.logs}/ts_log.log)"
        lines = [f"the model failed to load (TorchServe retries it; see {self.logs}/model_log.log):"]
        lines += [f"  rank {rank}/{self.world}: {error}" for rank, error in sorted(self.errors.items())]
        recent = list(self.recent)
        starts = [i for i, text in enumerate(recent) if text.startswith("Traceback (most recent call last)")]
        if starts:
            block = recent[starts[-1] + 1:]
            end = next((i for i, text in enumerate(block) if not text.startswith(" ")), len(block) - 1)
            lines.append("  the traceback ends:")
            lines += ["    " + text for text in block[max(0, end - 4):end + 1]]
        return "\n".join(lines)


def describe(figures: dict) -> str:
    parts = []
    for key, value in figures.items():
        if key == "bytes":
            parts.append(f"{int(value) / 1e6:.1f} MB")
        elif key == "seconds":
            parts.append(f"{value} s")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def wait(url: str, key_file: str, timeout: float, logs: str | None = None, show=None,
         since: float | None = None) -> str:
    """The inference key, once the model answers. With logs (TorchServe's log folder, read
    from the lines stamped at or after since): show(status, event), if given, gets each rank's
    new stage of loading, and a worker that fails to load raises LoadFailed at once."""
    start = time.monotonic()
    loading = Loading(logs, since) if logs else None
    answered, stop, last = threading.Event(), threading.Event(), [None, ""]
    # a request sent while the model loads waits for it: the logs are read meanwhile
    threading.Thread(target=probe, args=(url, key_file, answered, stop, last), daemon=True).start()
    try:
        while not answered.wait(0.25):
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"TorchServe did not answer within {timeout:.0f} s (last: {last[0]} "
                                   f"{last[1][:300]}){stuck(loading, start)}; see {logs or 'logs'}/model_log.log")
            if loading:
                report(loading, start, show)
                if loading.failed:
                    raise LoadFailed(loading.failure())
    finally:
        stop.set()
    if loading:
        report(loading, start, show)  # the last ranks' last lines
    return inference_key(key_file)


def stuck(loading: Loading | None, start: float) -> str:
    """Where the loading stood, for a timeout's message: the ranks' stages and the model log's
    last message (a CI log keeps only the error's line)."""
    if not loading:
        return ""
    last = loading.recent[-1][:300] if loading.recent else "nothing"
    return f"; {loading.status(time.monotonic() - start)}; the model log's last message: {last}"


def report(loading: Loading, start: float, show):
    for event in loading.poll():
        if show:
            show(loading.status(time.monotonic() - start), event)


def probe(url: str, key_file: str, answered: threading.Event, stop: threading.Event, last: list):
    """Send a one-token request every 2 s until one is answered; last: the last (status, body)."""
    while not stop.is_set():
        try:
            last[:] = post(f"{url}/predictions/llama", {"prompt": "Hello", "max_new_tokens": 1},
                           inference_key(key_file))
            if last[0] == 200:
                answered.set()
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        stop.wait(2)


class Display:
    """Progress as one line rewritten in place on a terminal, or a line per event elsewhere."""

    def __init__(self, out=sys.stdout):
        self.out, self.tty = out, out.isatty()

    def __call__(self, status: str, event: str):
        if self.tty:
            self.out.write(f"\r\033[K{status}; {event}")
        else:
            self.out.write(f"{status}; {event}\n")
        self.out.flush()

    def end(self):
        if self.tty:
            self.out.write("\n")


EXAMPLES = [
    ("text", {"prompt": "The secret of a happy life is", "max_new_tokens": 40, "temperature": 0.7, "seed": 1}),
    ("chat", {"dialog": [{"role": "user", "content": "What should I do on a rainy day?"}],
              "max_new_tokens": 40, "temperature": 0.7, "seed": 1}),
]


def show_examples(url: str, key: str) -> bool:
    """Whether every example answered HTTP 200."""
    answered = True
    print(f"\nTorchServe serves the model as 'llama' at {url}. The inference key is in key_file.json:")
    print("  KEY=$(python3 -c \"import json; print(json.load(open('key_file.json'))['inference']['key'])\")")
    for kind, body in EXAMPLES:
        print(f"\n{kind}:\n  curl -s {url}/predictions/llama -H \"Authorization: Bearer $KEY\" "
              f"-H 'Content-Type: application/json' -d '{json.dumps(body)}'")
        status, text = post(f"{url}/predictions/llama", body, key)
        print(f"  -> {status} {text}")
        answered &= status == 200
    print("\nStop it with: make stop")
    return answered


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--key-file", default="key_file.json")
    ap.add_argument("--logs", default="logs", help="TorchServe's log folder")
    ap.add_argument("--since", type=float, help="when TorchServe started (seconds since the epoch): "
                    "older log lines are an earlier run's")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--examples", action="store_true")
    a = ap.parse_args()
    display = Display()
    start = time.monotonic()
    try:
        key = wait(a.url, os.path.abspath(a.key_file), a.timeout, a.logs, display, a.since)
    except (TimeoutError, LoadFailed) as e:
        display.end()
        sys.exit(str(e))
    display.end()
    print(f"the model answers, {time.monotonic() - start:.0f} s after TorchServe started")
    if a.examples and not show_examples(a.url, key):
        sys.exit("an example did not answer HTTP 200")


if __name__ == "__main__":
    main()
