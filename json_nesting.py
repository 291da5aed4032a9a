"""How deep a client's JSON nests. What walks a request's JSON (json.dumps, the schema
tightening, the tool-call walkers, chat templates, llguidance's compiler) recurses as deep as
it nests, so JSON nested deeper than MAX_DEPTH is refused, saying where, before any of them
runs: a 400, never a RecursionError."""

import json

MAX_DEPTH = 64  # arrays and objects within each other; OpenAI's strict schemas allow 10 levels of nesting


class TooDeep(ValueError):
    def __init__(self, path: list):
        self.path = path  # keys and indices to the array or object too deep ([]: not known)
        super().__init__(self.describe("the JSON"))

    def describe(self, whole: str) -> str:
        """The problem, naming where: whole is the name of the whole value, for a path not known."""
        return f"{shown(self.path) or whole} nests arrays and objects more than {MAX_DEPTH} levels deep"


def check(value, path: tuple = ()):
    """Raises TooDeep, with the path (keys and indices from value, after path) to the first
    array or object nested more than MAX_DEPTH levels deep, if there is one. Iterative."""
    parents = [(-1, None)]  # (parent's index here, key in it) of each container met
    stack = [(value, 1, 0)]
    while stack:
        node, depth, at = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                parents.append((at, key))
                if depth + 1 > MAX_DEPTH:
                    raise TooDeep(list(path) + keys_to(parents, len(parents) - 1))
                stack.append((child, depth + 1, len(parents) - 1))


def keys_to(parents: list, at: int) -> list:
    keys = []
    while at > 0:
        at, key = parents[at]
        keys.append(key)
    return keys[::-1]


def loads(text: str, path: tuple = (), **options):
    """json.loads(text, **options), checked (path: where text is, for TooDeep). JSON nested
    too deeply for json.loads itself (a RecursionError, past about 900 levels) is TooDeep too."""
    try:
        value = json.loads(text, **options)
    except RecursionError:
        raise TooDeep(list(path)) from None
    check(value, path)
    return value


def shown(path: list) -> str:
    """A path as a request names a field: messages[0].content, cut after a few steps."""
    text = ""
    for key in path[:6]:
        text += f"[{key}]" if isinstance(key, int) else f".{key}" if text else str(key)
    return text + ("..." if len(path) > 6 else "")
