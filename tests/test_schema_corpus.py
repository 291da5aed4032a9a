"""The client's own JSON schema is what structured outputs enforce (issue 44, item 1), over a
corpus: the JSON-Schema-Test-Suite's draft 2020-12 schemas (tests/data/json_schema_suite,
vendored: its README) and real-world ones (tests/data/real_world_schemas.json: pydantic's,
tools', OpenAI's strict ones; allOf, anyOf, oneOf, $ref, enum, const, large and exclusive
bounds, formats, tuples...), both in the suite's format. Tightening refuses nothing that
llguidance compiles as written, what is refused says which keyword, and the demo model's
answers at temperature 1 (3 seeds) meet the schema as the client wrote it (jsonschema)."""

import glob
import json
import os
import re
from decimal import Decimal, localcontext

import jsonschema
import pytest
from llguidance import LLMatcher

import llama2
import structured
from conftest import DEMO, ROOT
from engine import Engine
from sequence import SamplingParams
from structured import Constraint

DATA = os.path.join(ROOT, "tests", "data")
FILES = sorted(glob.glob(os.path.join(DATA, "json_schema_suite", "*.json"))) + \
    [os.path.join(DATA, "real_world_schemas.json")]
CORPUS = {f"{os.path.basename(path)}: {group['description']}": group for path in FILES
          for group in json.load(open(path))}
PROMPT = "Answer in JSON:"
SEEDS = 3
MAX_TOKENS = 96  # the demo model's free strings can run long: such answers end "length" and go unchecked
FINISHED = 0.8  # of the answers, at least


def decimal_multiple_of(validator, divisor, instance, schema):
    """multipleOf on the numbers as written (schemas and answers are read with Decimal floats): jsonschema
    divides floats, and 17.2778 / 0.0001 is 172777.99999999997 there, though 17.2778 is a
    multiple of 0.0001."""
    if not validator.is_type(instance, "number"):
        return
    with localcontext(prec=1000):  # exact for every double's quotient by another
        whole = Decimal(str(instance)) % Decimal(str(divisor)) == 0
    if not whole:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"multipleOf": decimal_multiple_of})


def llguidance_error(schema) -> str:
    """What llguidance says of schema, handed as it is ('' if it compiles)."""
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema, defaults=structured.JSON_OPTIONS))


def our_error(schema) -> str:
    """What the server says of schema ('' if it compiles)."""
    try:
        return LLMatcher.validate_grammar(structured.grammar_text(Constraint("json_schema", schema)))
    except ValueError as e:
        return str(e)


def words(schema) -> set[str]:
    """The keywords (and string values, such as formats) in a schema, JSON values left out."""
    found, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found |= set(node)
            stack += [v for k, v in node.items() if k not in ("const", "enum", "default", "examples")]
        elif isinstance(node, list):
            stack += node
        elif isinstance(node, str):
            found.add(node)
    return found


def test_the_corpus_is_large_and_mixed():
    assert len(CORPUS) >= 60 and len(json.load(open(FILES[-1]))) >= 40
    suite = [name for name in CORPUS if not name.startswith("real_world")]
    assert len(suite) >= 300, "the suite's draft 2020-12 files are vendored (tests/data/json_schema_suite/README.md)"


@pytest.mark.parametrize("name", CORPUS)
def test_tightening_refuses_only_what_llguidance_refuses(name):
    """A schema that llguidance compiles as written compiles tightened; one refused is
    refused naming what in it is wrong (a keyword, a format, a reference), or it has no
    valid instance at all."""
    schema = CORPUS[name]["schema"]
    if not isinstance(schema, dict):
        return  # a boolean schema: refused by the API ("expected a JSON object")
    as_written, ours = llguidance_error(schema), our_error(schema)
    if not as_written:
        assert not ours, ours
    if ours:
        valid = [t for t in CORPUS[name]["tests"] if t["valid"]]
        named = [w for w in words(schema) if re.search(rf"(?<![\w$]){re.escape(w)}(?!\w)", ours)]
        assert named or (not valid and "Unsatisfiable" in ours), ours
        assert "\n" not in ours.strip() or "while processing" in ours, ours  # llguidance's message, not its state


@pytest.fixture(scope="module")
def answers() -> dict:
    """Each schema that compiles: its SEEDS answers (sequences), all decoded together."""
    llama = llama2.tp_llama(None, DEMO, None, 1, max_batch_size=32, max_seq_len=128)
    engine = Engine(llama.runner, llama.tokenizer)
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    out = {}
    for name, group in CORPUS.items():
        schema = group["schema"]
        if isinstance(schema, dict) and not our_error(schema):
            out[name] = [engine.add(prompt, SamplingParams(MAX_TOKENS, temperature=1.0, top_p=1.0, seed=seed,
                                                           constraint=Constraint("json_schema", schema)))
                         for seed in range(SEEDS)]
    while engine.running:
        engine.step()
    return out


@pytest.mark.slow  # decodes 3 answers for each of ~300 schemas
def test_answers_meet_the_clients_own_schema(answers):
    """Every answer the grammar finished is valid JSON that the schema as given accepts (not
    the tightened one), and most answers finish within MAX_TOKENS."""
    # jsonschema matches patterns with Python's re, which has no Unicode classes (\p{Letter})
    seqs = [(name, seq) for name, group in answers.items() for seq in group
            if "\\p{" not in json.dumps(CORPUS[name]["schema"])]
    finished = [(name, seq) for name, seq in seqs if seq.finish_reason == "stop"]
    assert all(seq.finish_reason in ("stop", "length") for _, seq in seqs)
    for name, seq in finished:
        schema = json.loads(json.dumps(CORPUS[name]["schema"]), parse_float=Decimal)
        validator = Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        errors = [e.message for e in validator.iter_errors(json.loads(seq.text, parse_float=Decimal))]
        assert not errors, (name, seq.text, errors)
    assert len(finished) >= FINISHED * len(seqs), \
        f"most answers finish within {MAX_TOKENS} tokens: {len(finished)} of {len(seqs)}; cut: " + \
        "; ".join(f"{name}: {seq.text[:60]!r}" for name, seq in seqs if seq.finish_reason != "stop")

