"""The product's modules (what the archive ships: tools/build_mar.py) import one way: no
module reaches itself through its imports, those inside functions included."""

import ast
import glob
import os

from conftest import ROOT

MODULES = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}


def imports(path: str) -> set[str]:
    """The product modules path imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found & set(MODULES)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that is on one, as the path that closes it."""
    found, done = [], set()

    def visit(module: str, path: list[str]):
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for other in sorted(graph[module]):
            visit(other, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def test_the_product_modules_import_without_cycles():
    graph = {name: imports(path) for name, path in MODULES.items()}
    assert not cycles(graph), " ; ".join(" -> ".join(c) for c in cycles(graph))


def test_a_cycle_is_found():
    """The check itself: a cycle three modules long, and one inside a function's imports."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert imports(os.path.join(ROOT, "generate.py")) >= {"engine"}  # its seed functions run the engine


def test_every_api_implements_the_answer_format():
    """The handler asks the native API (native_api), OpenAI's (openai_api, responses_api) and
    Anthropic's (messages_api) the same things (api.Format), with the same parameters."""
    import inspect

    import api
    import messages_api
    import native_api
    import openai_api
    import responses_api

    for module in (native_api, openai_api, responses_api, messages_api):
        assert isinstance(module, api.Format), module.__name__
        for name in ("answer", "chunk", "last_chunks", "error", "error_tail"):
            wanted = list(inspect.signature(getattr(api.Format, name)).parameters)[1:]  # less self
            assert list(inspect.signature(getattr(module, name)).parameters)[:len(wanted)] == wanted, name


def test_no_module_shares_a_name_with_a_folder():
    """`import tools` must never depend on whether tools/ has an __init__.py, or on sys.path's order."""
    folders = {name for name in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, name))}
    assert not set(MODULES) & folders, sorted(set(MODULES) & folders)
