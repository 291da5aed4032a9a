"""Wait until TorchServe answers a generation request, then show how to call it.

    python tools/wait_ready.py --url http://127.0.0.1:8080 --key-file key_file.json --examples
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


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


def wait(url: str, key_file: str, timeout: float) -> str:
    """The inference key, once the model answers."""
    deadline = time.time() + timeout
    status, text = None, ""
    while time.time() < deadline:
        key = inference_key(key_file)
        try:
            status, text = post(f"{url}/predictions/llama", {"prompt": "Hello", "max_new_tokens": 1}, key)
            if status == 200:
                return key
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise TimeoutError(f"TorchServe did not answer within {timeout:.0f} s (last: {status} {text[:300]}); "
                       "see logs/model_log.log")


EXAMPLES = [
    ("text", {"prompt": "The secret of a happy life is", "max_new_tokens": 40, "temperature": 0.7, "seed": 1}),
    ("chat", {"dialog": [{"role": "user", "content": "What should I do on a rainy day?"}],
              "max_new_tokens": 40, "temperature": 0.7, "seed": 1}),
]


def show_examples(url: str, key: str):
    print(f"\nTorchServe serves the model as 'llama' at {url}. The inference key is in key_file.json:")
    print(f"  KEY=$(python3 -c \"import json; print(json.load(open('key_file.json'))['inference']['key'])\")")
    for kind, body in EXAMPLES:
        print(f"\n{kind}:\n  curl -s {url}/predictions/llama -H \"Authorization: Bearer $KEY\" "
              f"-H 'Content-Type: application/json' -d '{json.dumps(body)}'")
        status, text = post(f"{url}/predictions/llama", body, key)
        print(f"  -> {status} {text}")
    print("\nStop it with: make stop")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--key-file", default="key_file.json")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--examples", action="store_true")
    a = ap.parse_args()
    try:
        key = wait(a.url, os.path.abspath(a.key_file), a.timeout)
    except TimeoutError as e:
        sys.exit(str(e))
    if a.examples:
        show_examples(a.url, key)


if __name__ == "__main__":
    main()
