"""Mixed load against one server for a while: what one client sends must not hurt the others.

    python bench/mixed_load.py [--minutes 5] [--clients 8] [--checkpoint demo|smollm2] [--no-write]

TorchServe with our handler (TP=1, batchSize 8, speculation by prompt lookup on) gets, from
--clients clients at once for --minutes, a random mix of requests on the native, OpenAI and
Anthropic routes: JSON schemas, regexes, choices, forced tool calls, stop strings, n > 1,
seeds, streams that the client closes after a few chunks (cancels), and invalid bodies. Each
answer is checked: no 5xx; an invalid body gets a 4xx; a constrained answer that finished
("stop") meets its constraint as the client wrote it (jsonschema, a full regex match, one of
the choices, the tool's parameters); a stop string never shows in the text; n answers come
back for n. The workers' resident memory is sampled every 5 s: it should stay flat after the
first minute. Writes BENCHMARKS.md's mixed_load section.
"""

import argparse
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import psutil
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools"), os.path.dirname(os.path.abspath(__file__))]
import report  # noqa: E402

CHECKPOINTS = {"demo": os.path.join(ROOT, "demo"), "smollm2": os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")}
PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ITEMS = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "maxItems": 4, "items": {
    "anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"enum": ["red", "green"]}]}}}}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["yes", "no", "maybe so"]
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 20}}}
PROMPTS = ["Tell me about the sea.", "Write a short poem about rain.", "What is the capital of France?",
           "Invent a person.", "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"]
NATIVE = "/predictions/llama"
CHAT = "/predictions/llama/1.0/v1/chat/completions"
COMPLETIONS = "/predictions/llama/1.0/v1/completions"
MESSAGES = "/predictions/llama/1.0/v1/messages"


def request(rng: random.Random) -> tuple[str, str, dict, object]:
    """(kind, path, body, check): one request of the mix, and what its answer must meet."""
    prompt = rng.choice(PROMPTS)
    user = [{"role": "user", "content": prompt}]
    seed = {"seed": rng.randrange(1000)} if rng.random() < 0.7 else {}
    sampling = {"temperature": rng.choice([0, 0.7, 1.0])} | seed
    kind = rng.choice(["schema", "items", "regex", "choice", "tool", "stop", "n", "plain", "cancel", "messages",
                       "invalid"])
    if kind == "schema":
        return kind, CHAT, {"messages": user, "max_tokens": 80, **sampling, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}, ("schema", PERSON)
    if kind == "items":
        return kind, COMPLETIONS, {"prompt": prompt, "max_tokens": 80, **sampling,
                                   "structured_outputs": {"json": ITEMS}}, ("schema", ITEMS)
    if kind == "regex":
        return kind, COMPLETIONS, {"prompt": "Call me at", "max_tokens": 30, **sampling, "guided_regex": PHONE}, \
            ("regex", PHONE)
    if kind == "choice":
        return kind, CHAT, {"messages": user, "max_tokens": 10, **sampling, "guided_choice": CHOICES}, \
            ("choice", CHOICES)
    if kind == "tool":
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
        return kind, CHAT, {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 60,
                            **sampling, "tools": tools, "tool_choice": "required"}, ("tool", WEATHER)
    if kind == "stop":
        stop = rng.choice([".", " the", "\n", "a"])
        return kind, COMPLETIONS, {"prompt": prompt, "max_tokens": 48, **sampling, "stop": [stop]}, ("stop", stop)
    if kind == "n":
        n = rng.choice([2, 3])
        return kind, COMPLETIONS, {"prompt": prompt, "max_tokens": 24, "n": n, "temperature": 0.9, **seed}, ("n", n)
    if kind == "messages":
        return kind, MESSAGES, {"model": "llama", "max_tokens": 40, "messages": user, **sampling}, ("messages", None)
    if kind == "plain":
        return kind, NATIVE, {"prompt": prompt, "max_new_tokens": 40, **sampling}, ("plain", None)
    if kind == "cancel":
        return kind, CHAT, {"messages": user, "max_tokens": 120, "stream": True, **sampling}, ("cancel", rng.randint(1, 4))
    bad = rng.choice([{"messages": user, "temperature": 5}, {"messages": "hi"}, {"messages": user, "max_tokens": -1},
                      {"messages": user, "response_format": {"type": "json_schema", "json_schema": {
                          "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
                      {"messages": user, "guided_regex": "(unclosed"}, {"messages": user, "n": 99}])
    return kind, CHAT, bad, ("invalid", None)


def judge(check, status: int, answer) -> str | None:
    """What is wrong with an answer (None: nothing)."""
    what, arg = check
    if status >= 500:
        return f"{status}: {str(answer)[:200]}"
    if what == "invalid":
        return None if 400 <= status < 500 else f"an invalid body got {status}"
    if status != 200:
        return f"{status}: {str(answer)[:200]}"
    if what == "cancel":
        return None
    if what == "plain":
        return None if isinstance(answer.get("generation"), str) else f"no generation: {str(answer)[:200]}"
    if what == "messages":
        return None if answer.get("type") == "message" else f"not a message: {str(answer)[:200]}"
    choices = answer["choices"]
    if what == "n":
        return None if len(choices) == arg else f"{len(choices)} choices for n={arg}"
    choice = choices[0]
    text = choice.get("text") if "text" in choice else choice["message"].get("content")
    if choice["finish_reason"] not in ("stop", "tool_calls"):
        return None if choice["finish_reason"] == "length" else f"finish_reason {choice['finish_reason']}"
    if what == "schema":
        return next((e.message for e in jsonschema.Draft202012Validator(arg).iter_errors(json.loads(text))), None)
    if what == "regex":
        return None if re.fullmatch(arg, text) else f"{text!r} does not match {arg}"
    if what == "choice":
        return None if text in arg else f"{text!r} is not a choice"
    if what == "tool":
        calls = choice["message"].get("tool_calls") or []
        if not calls:
            return f"no tool call: {text!r}"
        return next((e.message for e in jsonschema.Draft202012Validator(arg).iter_errors(
            json.loads(calls[0]["function"]["arguments"]))), None)
    if what == "stop":
        return None if arg not in text else f"stop string {arg!r} in {text!r}"
    return None


def send(url: str, headers: dict, path: str, body: dict, check) -> tuple[int, object]:
    if check[0] == "cancel":  # read a few chunks, then close the connection
        with requests.post(url + path, json=body, headers=headers, stream=True, timeout=300) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= check[1]:
                    break
            return r.status_code, None
    r = requests.post(url + path, json=body, headers=headers, timeout=300)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def workers_rss(server) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in server.worker_pids())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--checkpoint", choices=list(CHECKPOINTS), default="demo")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    from local_server import start_server

    path = CHECKPOINTS[a.checkpoint]
    handler = {"speculative": {"method": "ngram"}, "max_seq_len": 512}
    weights = path  # a folder goes into the archive; a GGUF file is read in place
    if path.endswith(".gguf"):
        handler |= {"checkpoint": path, "tokenizer": path}
        weights = None
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(tmp, weights, tp=1, batch_size=8, threads=a.threads, handler=handler, timeout=900)
        try:
            url, headers = server.url, {"Authorization": f"Bearer {server.key}"}
            pids = server.worker_pids()
            outcomes, problems, rss = Counter(), [], []
            begin = time.perf_counter()
            end = begin + a.minutes * 60
            stop = threading.Event()

            def sample():
                while not stop.wait(5):
                    rss.append((time.perf_counter() - begin, workers_rss(server)))

            def client(k: int):
                rng = random.Random(k)
                while time.perf_counter() < end:
                    kind, path_, body, check = request(rng)
                    try:
                        status, answer = send(url, headers, path_, body, check)
                        problem = judge(check, status, answer)
                    except Exception as e:  # a dropped connection, unreadable JSON: counted, not fatal
                        status, problem = 0, repr(e)
                    outcomes[(kind, status)] += 1
                    if problem:
                        problems.append(f"{kind}: {problem}")

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            with ThreadPoolExecutor(a.clients) as pool:
                list(pool.map(client, range(a.clients)))
            stop.set()
            elapsed = time.perf_counter() - begin
            same_workers = server.worker_pids() == pids
        finally:
            server.stop()
    after_minute = [b for t, b in rss if t >= 60] or [b for _, b in rss]
    served = sum(outcomes.values())
    errors = sum(n for (_, status), n in outcomes.items() if status >= 500 or status == 0)
    kinds = Counter()
    for (kind, status), n in outcomes.items():
        kinds[f"{kind} {status}"] += n
    lines = ["## Mixed load: what one client sends cannot hurt the others", "",
             f"{report.header()}; `python bench/mixed_load.py {' '.join(sys.argv[1:])}`.", "",
             f"{a.clients} clients for {elapsed / 60:.1f} minutes against TorchServe (TP=1, batchSize 8, "
             f"{a.threads} threads, speculation by prompt lookup), the {a.checkpoint} model: {served} requests.", "",
             "| measure | value |", "|---|---|",
             f"| requests answered 5xx, or dropped | {errors} |",
             f"| answers that broke their constraint, stop string or n (or an invalid body not a 4xx) | {len(problems)} |",
             f"| workers restarted | {'no' if same_workers else 'yes'} |",
             f"| workers' resident memory after the first minute: first / last / most (MB) | "
             f"{after_minute[0] / 2**20:.0f} / {after_minute[-1] / 2**20:.0f} / {max(after_minute) / 2**20:.0f} |",
             "", "Workers' resident memory at each minute (MB): " + ", ".join(
                 f"{b / 2**20:.0f}" for t, b in rss if int(t / 5) % 12 == 0) + ".",
             "", "Requests by kind and status: " + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) + "."]
    if problems:
        lines += ["", "First problems: " + "; ".join(problems[:5])]
    text = "\n".join(lines)
    report.publish("mixed_load", text, write=not a.no_write)
    sys.exit(1 if errors or problems else 0)


if __name__ == "__main__":
    main()
