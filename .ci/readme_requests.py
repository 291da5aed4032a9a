"""Send the requests of the README's two-command walk-through (its `curl -s ...` lines, as
`make serve` prints them) to the server `make serve` started, with the key in key_file.json;
fail unless each answers HTTP 200 with a non-empty generation. The standard library alone:
it runs before `make test` installs anything more."""

import json
import os
import re
import subprocess
import sys


def readme_requests(readme: str) -> list[str]:
    """The curl commands of the README's first block that shows `$ make serve`."""
    text = open(readme).read()
    block = re.search(r"```\n\$ make serve\n(.*?)```", text, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip().startswith("curl -s ")]


def generation_text(answer: dict) -> str:
    generation = answer["generation"]
    return generation["content"] if isinstance(generation, dict) else generation


def main():
    key = json.load(open("key_file.json"))["inference"]["key"]
    commands = readme_requests(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    assert commands, "the README shows no request"
    for command in commands:
        run = subprocess.run(["bash", "-c", command + " -w '\\n%{http_code}'"], env=dict(os.environ, KEY=key),
                             capture_output=True, text=True, timeout=120)
        body, _, status = run.stdout.rpartition("\n")
        print(f"{command}\n  -> {status} {body}")
        if status != "200" or not generation_text(json.loads(body)):
            sys.exit(f"the README's request did not answer HTTP 200 with a generation: {status} {body}")


if __name__ == "__main__":
    main()
