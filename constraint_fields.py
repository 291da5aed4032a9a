"""The request fields that constrain an answer to a JSON schema, a regex, choices or a
grammar (structured.py enforces them): OpenAI's response_format, vLLM's structured_outputs
and its older guided_* fields. At most one per request; each problem is a RequestError
naming its field."""

from typing import Callable

from api import Request, RequestError
from structured import Constraint

# vLLM's structured_outputs keys (and its older guided_<key> fields): the constraint kind each gives
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
GUIDED_FIELDS = tuple(f"guided_{key}" for key in STRUCTURED_KINDS)
RESPONSE_FORMATS = ("text", "json_object", "json_schema")  # OpenAI's response_format types
# what is wrong with a field's constraint that does not compile (llguidance's reason follows)
PROBLEM = {"json_schema": "is not a JSON schema that can be enforced", "json_object": "is not a valid JSON object",
           "regex": "is not a valid regular expression", "choice": "is not a valid list of choices",
           "grammar": "is not a valid grammar"}


def get_constraint(body: dict, names: tuple[str, ...], to_compile: list) -> Constraint | None:
    """The constraint that one of the fields names gives (None: the text is free), noted in
    to_compile (check_compiles); several are refused, naming them all."""
    given = {name: found for name in names if body.get(name) is not None
             and (found := constraint_of(name, body[name])) is not None}
    if len(given) > 1:
        raise RequestError(f"{', '.join(given)} each constrain the output; give at most one of them",
                           next(iter(given)))
    if not given:
        return None
    name, (path, constraint) = given.popitem()
    check_compiles(constraint, to_compile, f"{path} {PROBLEM[constraint.kind]}", name)
    return constraint


def check_compiles(constraint: Constraint, to_compile: list, problem: str, param: str):
    """Note that constraint must compile, and how to refuse it if not (what is wrong, the
    field): compiling waits until every cheap check of the request has passed."""
    to_compile.append((constraint, problem, param))


def compile_constraints(req: Request, matcher: Callable):
    """Compile each constraint the request gave (matcher: the engine's Engine.matcher, which
    caches the grammar its sequences then copy); one that cannot compile is a RequestError
    naming its field, with llguidance's message."""
    for constraint, problem, param in req.to_compile:
        try:
            matcher(constraint)
        except ValueError as e:  # its message starts with the kind where the value's type is wrong
            raise RequestError(f"{problem}: {str(e).removeprefix(constraint.kind + ': ')}", param) from None


def constraint_of(name: str, value) -> tuple[str, Constraint] | None:
    """(where in the body, the constraint) that field name's value gives; None for none."""
    if name == "response_format":
        return response_format(value)
    if name == "structured_outputs":
        return structured_outputs(value)
    return name, Constraint(STRUCTURED_KINDS[name.removeprefix("guided_")], value)


def response_format(value) -> tuple[str, Constraint] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise RequestError(f"response_format must be an object whose type is {', '.join(RESPONSE_FORMATS)}",
                           "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", Constraint("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise RequestError("response_format.json_schema must be an object with the schema: "
                           '{"name": ..., "schema": {...}}', "response_format")
    return "response_format.json_schema.schema", Constraint("json_schema", spec["schema"])


def structured_outputs(value) -> tuple[str, Constraint]:
    """vLLM's structured_outputs: exactly one of its keys (those set to null do not count)."""
    keys = [k for k, v in value.items() if v is not None] if isinstance(value, dict) else []
    if len(keys) != 1 or keys[0] not in STRUCTURED_KINDS:
        raise RequestError(f"structured_outputs must be an object with exactly one of {', '.join(STRUCTURED_KINDS)}"
                           + (f", got {', '.join(keys)}" if keys else ""), "structured_outputs")
    return f"structured_outputs.{keys[0]}", Constraint(STRUCTURED_KINDS[keys[0]], value[keys[0]])
