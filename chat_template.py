"""A checkpoint's chat template, compiled as transformers compiles it (jinja2's immutable
sandbox, trim_blocks and lstrip_blocks, loop controls, tojson, raise_exception and
strftime_now) and rendered within bounds of size, work and time: the template comes with
a checkpoint and runs on what requests send."""

import contextlib
import contextvars
import functools
import json
import re
import time
from collections.abc import Iterator
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer


OPTIONS = {"trim_blocks": True, "lstrip_blocks": True, "extensions": ["jinja2.ext.loopcontrols"]}


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """template compiled as transformers compiles chat templates: jinja2's immutable sandbox,
    trim_blocks and lstrip_blocks, loop controls, tojson without HTML escaping,
    raise_exception and strftime_now; and within the bounds of BoundedSandbox."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(**OPTIONS)
    env.filters["tojson"] = tojson
    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters |= {"_counted": counted, "_checked": checked, "_written": written}  # what CountSteps adds
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    del env.globals["lipsum"]  # paragraphs by the count: no chat template needs them
    return env.from_string(template)


# --- bounds on a template's rendering -------------------------------------------------------
# The template comes with the checkpoint and runs on what requests send: jinja2's sandbox
# keeps it from Python's internals, these bounds keep each rendering small and short.

MAX_CHARS = 4_000_000  # characters (or items) of any value a template makes, and all it writes
# (its output, and the blocks and macros it renders on the way): a prompt of about a million
# tokens, beyond any Llama context
MAX_INT_BITS = 64  # template arithmetic counts and measures: 2 ** 100000 is refused
MAX_STEPS = 100_000  # loop iterations, calls, filters and operators in one rendering
# CPU seconds of the rendering thread, for steps that each take long (each is bounded by
# MAX_CHARS): its own work, so that a busy machine (other workers, another request's grammar
# compile) does not make a rendering that keeps within its bounds a refusal
MAX_SECONDS = 1.0
# calls inside one another (a macro that calls itself): a RecursionError here, before Python's
# own limit, which varies by process (inductor raises it) and whose depth cost seconds
MAX_DEPTH = 100


class TemplateLimit(Exception):
    """A rendering went beyond a bound."""


class Budget:
    """The steps, time and characters one rendering has left, and how deep its calls are."""

    def __init__(self):
        self.steps, self.deadline, self.chars = MAX_STEPS, time.thread_time() + MAX_SECONDS, MAX_CHARS
        self.depth = 0

    def write(self, text: str):
        self.chars -= len(text)
        if self.chars < 0:
            raise TemplateLimit(f"it writes more than {MAX_CHARS} characters")

    def step(self):
        self.steps -= 1
        if self.steps < 0:
            raise TemplateLimit(f"more than {MAX_STEPS} loop iterations, calls and operations")
        if time.thread_time() > self.deadline:
            raise TemplateLimit(f"rendering took more than {MAX_SECONDS} s of CPU")


BUDGET = contextvars.ContextVar("chat_template_budget", default=None)  # the rendering's on this thread


def step():
    """One step of the rendering (there is none while jinja2 folds constants at compile time)."""
    budget = BUDGET.get()
    if budget is not None:
        budget.step()


@contextlib.contextmanager
def nested():
    """A call of the rendering, inside the calls it is made in: at most MAX_DEPTH deep."""
    budget = BUDGET.get()
    if budget is None:
        yield
        return
    if budget.depth >= MAX_DEPTH:
        raise RecursionError(f"calls nested more than {MAX_DEPTH} deep")
    budget.depth += 1
    try:
        yield
    finally:
        budget.depth -= 1


@jinja2.pass_context  # which also keeps jinja2 from folding it into a constant at compile time
def written(context, value) -> str:
    """What an output tag or the text between tags writes, counted."""
    text = str(value)
    BUDGET.get().write(text)
    return text


def size(value) -> int:
    """The characters and items in value, those of the strings, lists and dicts inside it
    included; counting stops past MAX_CHARS."""
    total, todo = 0, [value]
    while todo and total <= MAX_CHARS:
        item = todo.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += len(item)
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += len(item)
            todo += item
    return total


def within_chars(n: int):
    if n > MAX_CHARS:
        raise TemplateLimit(f"a value of more than {MAX_CHARS} characters or items")


def within_bits(n: int):
    if n > MAX_INT_BITS:
        raise TemplateLimit(f"an integer of more than {MAX_INT_BITS} bits")


def checked(value):
    """value, if it is within the bounds."""
    if isinstance(value, int):
        within_bits(value.bit_length())
    within_chars(size(value))
    return value


def counted(iterable):
    """A for loop's items, each a step."""
    for item in iterable:
        step()
        yield item


def materialized(value):
    """An iterator (a filter's lazy result) as a list, refused as soon as it outgrows
    MAX_CHARS: it can then be measured, and cannot grow unseen inside a filter."""
    if not isinstance(value, Iterator):
        return value
    items, total = [], 0
    for item in value:
        step()
        total += 1 + size(item)
        within_chars(total)
        items.append(item)
    return items


def check_binop(operator: str, left, right):
    """Refuses, before it runs, an operator whose result would be beyond the bounds."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0:
        within_bits(left.bit_length() * right)
    elif operator == "*" and ints:
        within_bits(left.bit_length() + right.bit_length())
    elif operator == "*" and isinstance(right, int):
        within_chars(size(left) * right)
    elif operator == "*" and isinstance(left, int):
        within_chars(left * size(right))
    elif operator == "%" and isinstance(left, str):
        within_chars(format_bound(left, right))


def format_bound(fmt: str, *args, **kwargs) -> int:
    """At most what formatting fmt makes: its text and, for each field, every argument at the
    largest width written in fmt or given as an argument (with * or a nested field)."""
    widths = [int(d) if len(d) <= 9 else 10 ** 9 for d in re.findall(r"\d+", fmt)]  # longer: beyond anyway
    widths += [abs(i) for v in (*args, *kwargs.values())
               for i in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v])
               if isinstance(i, int)]
    return len(fmt) + (fmt.count("{") + fmt.count("%")) * (size([args, kwargs]) + max(widths, default=0))


def depth(value) -> int:
    """How deeply lists and dicts nest in value."""
    if isinstance(value, dict):
        value = list(value.values())
    return 1 + max(map(depth, value), default=0) if isinstance(value, (list, tuple)) else 0


def json_bound(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> int:
    """At most json.dumps(x, ...): each character escaped, each item on a line indented to its depth."""
    width = len(indent) if isinstance(indent, str) else indent or 0
    return (size(x) + 1) * ((12 if ensure_ascii else 6) + width * depth(x))


def pad_bound(s, width=80, *fill) -> int:
    return size(s) + width


def replace_bound(s, old, new, count=None) -> int:
    s, old, new = str(s), str(old), str(new)
    return len(s) + (s.count(old) if old else len(s) + 1) * len(new)


# str methods ("str.NAME") and filters whose result can be far larger than their inputs (a
# width, or a string put in at many places): a bound of its size, checked before it is made.
# Any other result is at most a few times its inputs, and checked once made.
GROWTH = {
    "str.center": pad_bound, "str.ljust": pad_bound, "str.rjust": pad_bound, "str.zfill": pad_bound,
    "center": pad_bound,
    "str.expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * tabsize,
    "str.replace": replace_bound, "replace": replace_bound,
    "str.join": lambda sep, items: size(items) + len(items) * len(sep),
    "join": lambda items, d="", attribute=None: size(items) + len(items) * len(str(d)),
    "str.format": format_bound, "format": format_bound,
    "str.format_map": lambda fmt, mapping: format_bound(fmt, mapping),
    "indent": lambda s, width=4, first=False, blank=False:
        len(s) + (s.count("\n") + 1) * (len(width) if isinstance(width, str) else width),
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True:
        size(s) * (1 + len(wrapstring or "\n")),
    "batch": lambda items, linecount, fill_with=None: size(items) + linecount,
    "tojson": json_bound, "pprint": lambda value: json_bound(value, indent=1),
}
PASSED = (jinja2.runtime.Context, nodes.EvalContext, jinja2.Environment)  # what filters may be given first


def bounded_filter(name: str, func):
    """func, a filter, as a step within the bounds."""
    @functools.wraps(func)  # with jinja2's mark of what it is passed first
    def run(*args, **kwargs):
        step()
        args = [materialized(a) for a in args]
        kwargs = {k: materialized(v) for k, v in kwargs.items()}
        if name in GROWTH:
            within_chars(GROWTH[name](*[a for a in args if not isinstance(a, PASSED)], **kwargs))
        return checked(func(*args, **kwargs))
    return run


class CountSteps(NodeTransformer):
    """Puts each for loop's items through the _counted filter, each ~ and list, tuple or dict
    literal (which jinja2 does not let a sandbox intercept) through _checked, and what each
    output writes through _written (blocks and macros collect theirs in lists, out of a
    sandbox's sight)."""

    def visit_Output(self, node):
        self.generic_visit(node)
        node.nodes = [nodes.Filter(child, "_written", [], [], None, None, lineno=child.lineno) for child in node.nodes]
        return node

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_counted", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return nodes.Filter(node, "_checked", [], [], None, None, lineno=node.lineno)

    visit_List = visit_Dict = visit_Concat  # literals: [s, s, s] is as long as s three times

    def visit_Tuple(self, node):
        return self.visit_Concat(node) if node.ctx == "load" else self.generic_visit(node)  # not a, b = ...


class BoundedTemplate(jinja2.Template):
    """A template whose every rendering has a Budget of its own."""

    def render(self, *args, **kwargs) -> str:
        budget = BUDGET.set(Budget())
        try:
            return super().render(*args, **kwargs)
        finally:
            BUDGET.reset(budget)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, within MAX_CHARS, MAX_INT_BITS, MAX_STEPS and MAX_SECONDS:
    each loop iteration, call, filter and arithmetic operator is a step; what could outgrow
    the bounds is refused before it is made, anything else once made; and what a rendering
    writes stops at MAX_CHARS. compile_template wraps the filters."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    template_class = BoundedTemplate

    def compile(self, source, name=None, filename=None, raw=False, defer_init=False):
        if isinstance(source, str):
            source = CountSteps().visit(self.parse(source, name, filename))
        return super().compile(source, name, filename, raw, defer_init)

    def call_binop(self, context, operator, left, right):
        step()
        check_binop(operator, left, right)
        return checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's names: none a template's keyword)
        step()
        args = [materialized(a) for a in args]
        kwargs = {k: materialized(v) for k, v in kwargs.items()}
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format and format_map
        receiver = getattr(method, "__self__", None)
        if isinstance(receiver, str) and f"str.{method.__name__}" in GROWTH:
            within_chars(GROWTH[f"str.{method.__name__}"](receiver, *args, **kwargs))
        with nested():
            return checked(super().call(__context, __obj, *args, **kwargs))
