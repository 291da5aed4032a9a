"""structured.py on every tokenizer backend (the demo's sentencepiece, and a Llama 3 BPE
trained here as Meta's tiktoken file, as tokenizer.json and as a GGUF file), with a model
vocabulary larger than the tokenizer's: tokens drawn uniformly at random among those the mask
allows, until the grammar is finished or a stop token is drawn, make text that the constraint
accepts (jsonschema validates JSON, re.fullmatch regexes), and the mask never allows padding
ids, special tokens, or a stop token where the grammar does not accept."""

import json
import random
import re

import jsonschema
import pytest
import torch

import make_checkpoint
import schema_tightening
import structured
from conftest import LLAMA3_RANKS, TOKENIZER, llama3_training_text
from test_gguf_tokenizer import llama_bpe_metadata, write_gguf
from structured import Constraint
from tokenizer import TextStream, Tokenizer, write_tiktoken_ranks

BACKENDS = ["sentencepiece", "tiktoken", "hf", "gguf"]
PADDING = 61  # model vocabulary rows past the tokenizer's; not a multiple of 32
MAX_TOKENS = 5000


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("structured")
    ranks = make_checkpoint.train_llama3_ranks(llama3_training_text(), LLAMA3_RANKS)
    write_tiktoken_ranks(ranks, str(folder / "tokenizer.model"))
    make_checkpoint.write_llama3_hf_tokenizer(ranks, str(folder / "hf"))
    gguf = write_gguf(folder / "llama3.gguf", llama_bpe_metadata(str(folder / "hf" / "tokenizer.json")))
    return {"sentencepiece": Tokenizer(TOKENIZER), "tiktoken": Tokenizer(str(folder / "tokenizer.model")),
            "hf": Tokenizer(str(folder / "hf")), "gguf": Tokenizer(gguf)}


def vocabulary_of(tok: Tokenizer) -> structured.Vocabulary:
    return structured.vocabulary(tok, tok.n_words + PADDING)


def allowed(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def mask_of(tok: Tokenizer, matcher: structured.Matcher) -> list[int]:
    bitmask = structured.new_bitmask(1, tok.n_words + PADDING)
    matcher.fill_bitmask(bitmask, 0)
    return allowed(bitmask)


def generate(tok: Tokenizer, constraint: Constraint, seed: int) -> str:
    """The text a request gets when each token is drawn uniformly among the allowed ones,
    checking every mask on the way."""
    matcher = vocabulary_of(tok).matcher(constraint)
    rng = random.Random(seed)
    prompt = tok.encode("Answer:", bos=True, eos=False)
    stream = TextStream(tok, prompt)
    text = ""
    for _ in range(MAX_TOKENS):
        ids = mask_of(tok, matcher)
        check_mask(tok, matcher, ids)
        token = rng.choice(ids)
        if token in tok.stop_ids:
            return text + stream.flush()
        assert matcher.consume(token), matcher.error()
        text += stream.add(token)
    raise AssertionError(f"{MAX_TOKENS} tokens and the grammar is not finished: {text[:200]!r}...")


def check_mask(tok: Tokenizer, matcher: structured.Matcher, ids: list[int]):
    assert ids and max(ids) < tok.n_words, "a padding id is allowed"
    assert not set(ids) & (set(tok.special_tokens.values()) - tok.stop_ids), "a special token is allowed"
    assert bool(set(ids) & tok.stop_ids) == matcher.is_accepting(), "stop tokens where the grammar does not accept"
    if matcher.is_finished():
        assert set(ids) == tok.stop_ids


# --- the adapter ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_llguidance_sees_our_tokens(tokenizers, backend):
    tok = tokenizers[backend]
    ll = vocabulary_of(tok).ll
    assert ll.vocab_size == tok.n_words + PADDING
    assert set(ll.eos_tokens) == tok.stop_ids
    special = set(tok.special_tokens.values()) | ({tok.sp_model.unk_id()} if backend == "sentencepiece" else set())
    for i in range(tok.n_words):
        marked = tok.token_bytes(i).startswith(b"\xff")  # llguidance's marker of special tokens: never UTF-8
        assert ll.is_special_token(i) == (i in special or marked), i
        if not ll.is_special_token(i):
            assert ll.decode_bytes([i]) == tok.token_bytes(i), i


def test_one_vocabulary_per_tokenizer(tokenizers):
    tok = tokenizers["tiktoken"]
    assert structured.vocabulary(tok, tok.n_words + PADDING) is vocabulary_of(tok)
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        structured.vocabulary(tok, tok.n_words - 1)


def test_compiled_grammars_are_cached(tokenizers):
    vocabulary = vocabulary_of(tokenizers["hf"])
    constraint = Constraint("regex", "cached [0-9]+")
    vocabulary.matcher(constraint)
    hits = structured.compiled.hits
    a, b = vocabulary.matcher(constraint), vocabulary.matcher(Constraint("regex", "cached [0-9]+"))
    assert structured.compiled.hits == hits + 2
    assert a.consume(vocabulary.ll.tokenize_str("c")[0])
    assert mask_of(tokenizers["hf"], a) != mask_of(tokenizers["hf"], b)  # copies, not one matcher


# --- JSON schemas --------------------------------------------------------------------------------

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "active"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
                                       "properties": {"name": NAME, "address": {
                                           "type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                           "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
                              "active": {"type": "boolean"}}},
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                     "minItems": 2, "maxItems": 4},
    "array_of_objects": {"type": "object", "additionalProperties": False, "required": ["items"],
                         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                             "type": "object", "additionalProperties": False, "required": ["id", "ok"],
                             "properties": {"id": {"type": "integer", "minimum": 1}, "ok": {"type": "boolean"}}}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
             "properties": {"color": {"enum": ["red", "green", "blue", "dark \"red\""]},
                            "size": {"enum": [1, 2.5, None, True, "XL"]}}},
    "const": {"type": "object", "additionalProperties": False, "required": ["version", "kind"],
              "properties": {"version": {"const": 3}, "kind": {"const": "café ☕"}}},
    "pattern": {"type": "object", "additionalProperties": False, "required": ["code", "hex"],
                "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                               "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}},
    "number_bounds": {"type": "object", "additionalProperties": False, "required": ["x", "y", "n"],
                      "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                     "y": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                     "n": {"type": "integer", "minimum": 10, "maximum": 1000}}},
    "multiple_of": {"type": "array", "maxItems": 5, "items": {"type": "integer", "multipleOf": 5,
                                                              "minimum": 0, "maximum": 100}},
    "optional_keys": {"type": "object", "additionalProperties": False, "required": ["id"],
                      "properties": {"id": {"type": "integer"}, "note": NAME, "score": {"type": "number"},
                                     "flag": {"type": "boolean"}}},
    "any_of": {"type": "array", "maxItems": 4, "items": {"anyOf": [
        {"type": "string", "maxLength": 5}, {"type": "integer", "minimum": 0},
        {"type": "object", "additionalProperties": False, "required": ["k"], "properties": {"k": {"type": "null"}}}]}},
    "one_of": {"oneOf": [{"type": "boolean"}, {"type": "object", "additionalProperties": False, "required": ["a"],
                                               "properties": {"a": {"type": "integer"}}}]},
    "all_of": {"type": "object", "properties": {"a": True, "b": True}, "additionalProperties": False,
               "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    "ref_defs": {"type": "object", "additionalProperties": False, "required": ["home", "work"],
                 "$defs": {"place": {"type": "object", "additionalProperties": False, "required": ["city", "floor"],
                                     "properties": {"city": NAME, "floor": {"type": "integer", "minimum": 0, "maximum": 99}}}},
                 "properties": {"home": {"$ref": "#/$defs/place"}, "work": {"$ref": "#/$defs/place"}}},
    "recursive_ref": {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "additionalProperties": False, "required": ["v"],
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                       "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}}}},
    "nullable": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                 "properties": {"a": {"type": ["string", "null"], "maxLength": 4}, "b": {"type": ["integer", "boolean"]}}},
    "string_lengths": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": {"type": "string", "minLength": 2, "maxLength": 6}},
    "tuple": {"type": "array", "prefixItems": [NAME, {"type": "integer"}, {"type": "boolean"}], "items": False,
              "minItems": 3},
    "map": {"type": "object", "patternProperties": {"^[a-z]{1,6}$": {"type": "integer"}},
            "additionalProperties": False, "maxProperties": 3},
    "formats": {"type": "object", "additionalProperties": False, "required": ["day", "id", "ip"],
                "properties": {"day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"},
                               "ip": {"type": "string", "format": "ipv4"}}},
    "open_object": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "maxProperties": 2},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema(tokenizers, backend, name):
    schema = SCHEMAS[name]
    for seed in range(3):
        text = generate(tokenizers[backend], Constraint("json_schema", schema), seed)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_as_text(tokenizers, backend):
    text = generate(tokenizers[backend], Constraint("json_schema", json.dumps(SCHEMAS["flat"])), 0)
    jsonschema.validate(json.loads(text), SCHEMAS["flat"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object(tokenizers, backend):
    for seed in range(3):
        assert isinstance(json.loads(generate(tokenizers[backend], Constraint("json_object"), seed)), dict)


# --- regexes, choices, grammars ------------------------------------------------------------------

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{2,8}\.(com|org|net)",
           r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?", r"\d{4}-\d{2}-\d{2}", r"(ab|c)+d?", r"Größe: [äöü]{2,3}",
           r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}\."]


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex(tokenizers, backend):
    for pattern in REGEXES:
        for seed in range(3):
            text = generate(tokenizers[backend], Constraint("regex", pattern), seed)
            assert re.fullmatch(pattern, text), (pattern, text)


CHOICES = ["yes", "no", "maybe so", "a", "ab", 'say "hi"', "line\nbreak", "naïve 日本 😀", ""]


@pytest.mark.parametrize("backend", BACKENDS)
def test_choice(tokenizers, backend):
    texts = {generate(tokenizers[backend], Constraint("choice", CHOICES), seed) for seed in range(30)}
    assert texts <= set(CHOICES) and len(texts) > 3, texts


LARK = r"""
start: expr
expr: term (("+" | "-") term){0,3}
term: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""
GBNF = r"""
root ::= greeting " " name "!"
greeting ::= "Hello" | "Hi"
name ::= [A-Z] [a-z]{1,6}
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_grammars(tokenizers, backend):
    for seed in range(5):
        expression = generate(tokenizers[backend], Constraint("grammar", LARK), seed)
        assert re.fullmatch(r"[0-9()+\-]+", expression) and isinstance(eval(expression), int), expression
        greeting = generate(tokenizers[backend], Constraint("grammar", GBNF), seed)
        assert re.fullmatch(r"(Hello|Hi) [A-Z][a-z]{1,6}!", greeting), greeting


# --- what cannot be compiled -------------------------------------------------------------------

BAD = [
    (Constraint("json_schema", {"type": "strin"}), "Invalid type: strin"),
    (Constraint("json_schema", {"type": "integer", "minimum": 5, "maximum": 2}), "minimum .* greater than maximum"),
    (Constraint("json_schema", {"$ref": "#/$defs/missing"}), "\\$ref .#/\\$defs/missing. leads nowhere"),
    (Constraint("json_schema", {"$ref": "https://example.com/a.json"}), "references to other documents are not"),
    (Constraint("json_schema", {"type": "object", "properties": {"a": {"not": {}}}}), "unsupported keyword: not"),
    (Constraint("json_schema", {"type": "string", "pattern": "(?=a)b"}), "look-around"),
    (Constraint("json_schema", {"type": "string", "format": "shoe-size"}), "Unknown format"),
    (Constraint("json_schema", "{not json"), "not JSON"),
    (Constraint("json_schema", [1, 2]), "expected a JSON object"),
    (Constraint("regex", "(ab"), "unclosed group"),
    (Constraint("regex", "[a-"), "unclosed character class"),
    (Constraint("regex", 12), "regex: expected a string"),
    (Constraint("choice", []), "non-empty list of strings"),
    (Constraint("choice", ["a", 1]), "non-empty list of strings"),
    (Constraint("grammar", "start: missing_rule"), "unknown name"),
    (Constraint("grammar", 'root ::= "a" missing'), "Rule 'missing' not found"),
    (Constraint("yaml", "a: 1"), "unknown constraint kind 'yaml'"),
]


@pytest.mark.parametrize("constraint, message", BAD)
def test_what_cannot_compile_says_why(tokenizers, constraint, message):
    with pytest.raises(ValueError, match=message):
        vocabulary_of(tokenizers["tiktoken"]).matcher(constraint)


# --- the matcher's life, bitmasks, logits --------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_finished_grammar_allows_only_stop_tokens(tokenizers, backend):
    tok = tokenizers[backend]
    matcher = vocabulary_of(tok).matcher(Constraint("choice", ["done"]))
    assert not matcher.is_accepting() and not matcher.is_finished()
    for token in vocabulary_of(tok).ll.tokenize_str("done"):
        assert matcher.consume(token)
    assert matcher.is_accepting() and matcher.is_finished()
    assert set(mask_of(tok, matcher)) == tok.stop_ids


def test_forbidden_token_breaks_the_matcher(tokenizers):
    tok = tokenizers["hf"]
    matcher = vocabulary_of(tok).matcher(Constraint("regex", "[0-9]+"))
    assert not matcher.consume(tok.encode_text("x")[0])
    assert matcher.error() and matcher.is_finished() and set(mask_of(tok, matcher)) == tok.stop_ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_returns_to_the_earlier_mask(tokenizers, backend):
    tok = tokenizers[backend]
    matcher = vocabulary_of(tok).matcher(Constraint("json_schema", SCHEMAS["flat"]))
    rng = random.Random(0)
    masks, consumed = [], 0
    for _ in range(12):
        masks.append(mask_of(tok, matcher))
        assert matcher.consume(rng.choice([t for t in masks[-1] if t not in tok.stop_ids]))
        consumed += 1
    for n in (5, 4, 3):
        matcher.rollback(n)
        consumed -= n
        assert mask_of(tok, matcher) == masks[consumed]


def test_fill_bitmasks_fills_rows_in_parallel(tokenizers):
    tok = tokenizers["tiktoken"]
    vocabulary = vocabulary_of(tok)
    constraints = [Constraint("json_schema", SCHEMAS[name]) for name in ("nested", "enum", "map")] + \
        [Constraint("regex", REGEXES[2]), Constraint("choice", CHOICES)]
    matchers = [vocabulary.matcher(c) for c in constraints]
    for matcher, token in zip(matchers, (tok.encode_text(t)[0] for t in ('{', '{', '{', 'x', 'ma'))):
        assert matcher.consume(token)
    rows = [(m, 2 * i) for i, m in enumerate(matchers)]  # odd rows: unconstrained
    bitmask = structured.new_bitmask(2 * len(matchers), vocabulary.vocab_size)
    structured.fill_bitmasks(bitmask, rows)
    for matcher, row in rows:
        assert allowed(bitmask, row) == mask_of(tok, matcher)
        assert (bitmask[row + 1] == -1).all()


def test_apply_bitmask_sets_forbidden_logits_to_minus_infinity():
    vocab = 100
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    masked = logits.clone()
    structured.apply_bitmask(masked, bitmask)
    for row in range(3):
        ok = set(allowed(bitmask, row))
        for t in range(vocab):
            assert masked[row, t] == (logits[row, t] if t in ok else float("-inf"))
    with pytest.raises(ValueError, match="does not fit"):
        structured.apply_bitmask(logits[:, :96], bitmask)


def test_a_bitmask_must_be_what_llguidance_writes_into(tokenizers):
    tok = tokenizers["hf"]
    matcher = vocabulary_of(tok).matcher(Constraint("json_object"))
    words = (tok.n_words + PADDING + 31) // 32
    for bad in (torch.zeros(1, words, dtype=torch.int64), torch.zeros(1, 2 * words, dtype=torch.int32)[:, ::2]):
        with pytest.raises(ValueError, match="contiguous 2-D int32"):
            matcher.fill_bitmask(bad, 0)
    with pytest.raises(ValueError):
        matcher.fill_bitmask(structured.new_bitmask(1, tok.n_words), 0)  # without the padding rows


SAFE = schema_tightening.SAFE
INT = {"type": "integer"}
BOUNDED_INT = {"type": "integer", "minimum": -SAFE, "maximum": SAFE}
OBJECT = {"type": "object", "properties": {"a": INT}}
TIGHTENED = [  # (schema as given, as enforced)
    (INT, BOUNDED_INT),
    ({"type": "number", "minimum": 0.5}, {"type": "number", "minimum": 0.5, "maximum": SAFE, "multipleOf": 1e-9}),
    ({"type": "integer", "minimum": 2 ** 60}, {"type": "integer", "minimum": 2 ** 60, "maximum": 2 ** 60 + SAFE}),
    ({"type": "integer", "exclusiveMaximum": -2 ** 60}, {"type": "integer", "exclusiveMaximum": -2 ** 60,
                                                         "minimum": -2 ** 60 - SAFE}),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-10},  # no multiple of 1e-9 inside
     {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-10}),
    ({"type": "number", "minimum": 1e-12, "maximum": 1}, {"type": "number", "minimum": 1e-12, "maximum": 1}),
    ({"type": "number", "multipleOf": 0.5}, {"type": "number", "multipleOf": 0.5, "minimum": -SAFE, "maximum": SAFE}),
    ({"type": "number", "enum": [1e-12, 3]}, {"type": "number", "enum": [1e-12, 3]}),
    ({"type": "integer", "const": 2 ** 60}, {"type": "integer", "const": 2 ** 60}),
    ({"type": "array", "maxItems": 2.0}, {"type": "array", "maxItems": 2}),
    (OBJECT, {"type": "object", "properties": {"a": BOUNDED_INT}, "additionalProperties": False}),
    (OBJECT | {"required": ["a", "b"]}, OBJECT | {"properties": {"a": BOUNDED_INT}, "required": ["a", "b"]}),
    (OBJECT | {"required": ["a"], "minProperties": 2},
     OBJECT | {"properties": {"a": BOUNDED_INT}, "required": ["a"], "minProperties": 2}),
    (OBJECT | {"allOf": [OBJECT]}, OBJECT | {"properties": {"a": BOUNDED_INT}, "allOf": [
        OBJECT | {"properties": {"a": BOUNDED_INT}}]}),
    ({"anyOf": [OBJECT, INT]}, {"anyOf": [OBJECT | {"properties": {"a": BOUNDED_INT}, "additionalProperties": False},
                                           BOUNDED_INT]}),
    ({"required": ["b"], "anyOf": [OBJECT]}, {"required": ["b"], "anyOf": [OBJECT | {"properties": {"a": BOUNDED_INT}}]}),
    ({"oneOf": [OBJECT, INT]}, {"oneOf": [OBJECT, INT]}),
    ({"$defs": {"o": OBJECT}, "properties": {"x": {"$ref": "#/$defs/o", "description": "x"}}},
     {"$defs": {"o": OBJECT | {"properties": {"a": BOUNDED_INT}, "additionalProperties": False}},
      "properties": {"x": {"$ref": "#/$defs/o", "description": "x"}}}),
    ({"$defs": {"o": OBJECT}, "properties": {"x": {"$ref": "#/$defs/o", "required": ["a"]}}},
     {"$defs": {"o": OBJECT | {"properties": {"a": BOUNDED_INT}}}, "properties": {"x": {"$ref": "#/$defs/o",
                                                                                        "required": ["a"]}}}),
    ({"$defs": {"o": OBJECT}, "properties": {"x": {"$ref": "#/$defs/o"}, "y": {"oneOf": [{"$ref": "#/$defs/o"}]}}},
     {"$defs": {"o": OBJECT}, "properties": {"x": {"$ref": "#/$defs/o"}, "y": {"oneOf": [{"$ref": "#/$defs/o"}]}}}),
    ({"$defs": {"unused": INT}, "const": {"type": "integer"}}, {"$defs": {"unused": INT}, "const": {"type": "integer"}}),
]


@pytest.mark.parametrize("schema, enforced", TIGHTENED, ids=range(len(TIGHTENED)))
def test_schemas_are_tightened_only_where_the_client_left_them_free(tokenizers, schema, enforced):
    """A number is bounded on a side its schema leaves open, never against its own bounds,
    nor beside enum or const; an object that names its properties and says nothing else of
    other keys is closed, unless it combines or refers to schemas, is an allOf's part, is
    referred to beside other keywords; nothing under oneOf, nor what it refers to, nor JSON
    values, is touched. The result compiles (schema_corpus: answers meet the schema
    as given)."""
    assert schema_tightening.tightened(schema) == enforced
    vocabulary_of(tokenizers["hf"]).matcher(Constraint("json_schema", schema))


def test_deep_schemas_are_refused_before_llguidance_recurses(tokenizers):
    """A chain of references overflowed llguidance's stack (a crash, not an error) at about
    950 links: the depth through references is bounded; a recursive schema is not deep, and
    a schema whose references multiply its paths costs no more than its size."""
    chain = {"$defs": {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(1000)},
             "$ref": "#/$defs/d0"}
    chain["$defs"]["d1000"] = INT
    with pytest.raises(ValueError, match="nests schemas more than 64 levels deep, counting each \\$ref"):
        vocabulary_of(tokenizers["hf"]).matcher(Constraint("json_schema", chain))
    doubling = {"$defs": {f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}] * 2}
                          for i in range(30)} | {"d30": INT}, "$ref": "#/$defs/d0"}
    vocabulary_of(tokenizers["hf"]).matcher(Constraint("json_schema", doubling))  # 2^30 paths, 31 deep
    text = '{"items": ' * 70 + "{}" + "}" * 70
    with pytest.raises(ValueError, match=r"json_schema: items\.items\.items.* more than 64 levels deep"):
        vocabulary_of(tokenizers["hf"]).matcher(Constraint("json_schema", text))
