"""Structured outputs end to end (issue 30, item 1): the request fields that ask for them
(OpenAI's response_format, vLLM's structured_outputs and guided_*, the native
structured_outputs) and what is refused, naming the field; the engine sampling within each
sequence's grammar on the demo model (JSON schemas validated by jsonschema at temperature 1
with several seeds, regexes, choices, JSON objects, grammars), ending at the grammar's end,
or with "length" inside it; unconstrained sequences beside them unchanged; logprobs from the
raw logits; min_tokens, stop ids, n, seeds, prefix caching and preemption; TP=2 ranks
agreeing; and the openai client against TorchServe."""

import json
import re
import threading

import jsonschema
import openai
import pytest
from llguidance import LLMatcher, LLParserLimits

import api
import constraint_fields
import llama2
import native_api
import openai_api
import sampler
import structured
from api import Defaults, Limits, RequestError
from conftest import DEMO, parting, read_now
from engine import Engine
from engine_worker import CONSTRAINTS, constrained
from sequence import SamplingParams
from serving import InFlight
from structured import Constraint
from test_generate import ScriptedRunner
from test_structured import LARK, REGEXES, SCHEMAS
from torchrun import run

MAX_SEQ_LEN = 512
PROMPT = "Answer in JSON:"
# schemas whose answers the demo model finishes well within max_gen_len (its runs of up to 24
# blank lines, which JSON allows, make deeply nested ones long)
VALIDATED = ["enum", "number_bounds", "tuple", "array_bounds", "optional_keys", "const"]
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def llama():
    return llama2.tp_llama(None, DEMO, None, 1, max_batch_size=8, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture
def engine(llama):
    return Engine(llama.runner, llama.tokenizer)


def params(constraint: Constraint | None = None, **settings) -> SamplingParams:
    return SamplingParams(**({"max_gen_len": 400, "temperature": 1.0, "top_p": 1.0} | settings), constraint=constraint)


def generate(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list:
    """Every (prompt, params) through the engine together; their sequences, done."""
    tok = engine.tokenizer
    seqs = [engine.add(tok.encode(prompt, bos=True, eos=False), p) for prompt, p in requests]
    while engine.running:
        engine.step()
    assert engine.pool.num_used == 0
    return seqs


def check(constraint: Constraint, text: str):
    """text is what constraint asks for (a grammar: LARK's arithmetic)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), value, format_checker=jsonschema.FormatChecker())
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(value, text), (value, text)
    elif kind == "choice":
        assert text in value, text
    else:
        assert value == LARK and isinstance(eval(text), int), text


# --- the engine ---------------------------------------------------------------------------------

def test_json_schema_answers_validate(engine):
    requests = [(PROMPT, params(Constraint("json_schema", SCHEMAS[name]), seed=seed))
                for name in VALIDATED for seed in range(3)]
    seqs = generate(engine, requests)
    for seq in seqs:
        assert seq.finish_reason == "stop" and seq.stop_token is None, seq.text  # the grammar's end
        check(seq.params.constraint, seq.text)
    for i, name in zip(range(0, len(seqs), 3), VALIDATED):
        if name != "const":  # the one schema with a single answer
            assert len({seq.text for seq in seqs[i:i + 3]}) > 1, seqs[i].text  # temperature 1: seeds differ


def test_regexes_choices_json_objects_and_grammars(engine):
    requests = [("Call me at", params(Constraint("regex", pattern), seed=seed)) for pattern in REGEXES
                for seed in range(2)]
    requests += [("He said", params(Constraint("choice", CHOICES), seed=seed)) for seed in range(6)]
    # top_p 0.5: at full temperature the demo model's free strings go on for hundreds of tokens
    requests += [(PROMPT, params(Constraint("json_object"), seed=seed, top_p=0.5)) for seed in range(3)]
    requests += [("2 + 2 =", params(Constraint("grammar", LARK), seed=seed)) for seed in range(2)]
    seqs = generate(engine, requests)
    assert all(seq.finish_reason == "stop" for seq in seqs), [seq.text for seq in seqs]
    for seq in seqs:
        check(seq.params.constraint, seq.text)
    assert len({seq.text for seq in seqs if seq.params.constraint.kind == "choice"}) > 1


def test_max_tokens_inside_a_structure_ends_with_length(engine):
    schema = SCHEMAS["enum"]
    seq, = generate(engine, [(PROMPT, params(Constraint("json_schema", schema), max_gen_len=5, seed=0))])
    assert seq.finish_reason == "length" and len(seq.tokens) == 5 and seq.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(seq.text)


def test_unconstrained_sequences_are_unchanged(llama):
    """Greedy and seeded sequences, with logprobs and penalties, give the same tokens and
    logprobs beside constrained ones as alone."""
    free = [("Once upon a time", params(max_gen_len=24, temperature=0, logprobs=True)),
            ("The secret of a happy life is", params(max_gen_len=24, seed=3, logprobs=True, top_logprobs=2)),
            ("Why is the sky blue?", params(max_gen_len=24, seed=4, presence_penalty=0.5, top_k=20))]
    alone = generate(Engine(llama.runner, llama.tokenizer), free)
    constrained_ones = [(PROMPT, params(Constraint("json_schema", SCHEMAS["enum"]), seed=1)),
                        ("He said", params(Constraint("choice", CHOICES), temperature=0))]
    mixed = generate(Engine(llama.runner, llama.tokenizer), constrained_ones[:1] + free + constrained_ones[1:])[1:-1]
    for a, m in zip(alone, mixed):
        assert (m.tokens, m.text, m.finish_reason) == (a.tokens, a.text, a.finish_reason)
        assert m.logprobs == pytest.approx(a.logprobs, abs=1e-5) and m.matcher is None


def test_logprobs_are_the_raw_logits(engine):
    """A constrained sequence's logprobs are the model's own for the tokens it took (as the
    prompt's scores of the same tokens say), not the masked distribution's."""
    tok = engine.tokenizer
    seq, = generate(engine, [("He said", params(Constraint("choice", ["maybe so"]), temperature=0,
                                                  logprobs=True))])
    assert seq.text == "maybe so" and len(seq.logprobs) == len(seq.tokens)
    prompt = tok.encode("He said", bos=True, eos=False)
    scored = engine.add(prompt + seq.tokens, SamplingParams(max_gen_len=0, logprobs=True, echo=True))
    while engine.running:
        engine.step()
    assert seq.logprobs == pytest.approx(scored.prompt_logprobs[len(prompt):], abs=1e-4)
    assert min(seq.logprobs) < -1  # forced: not what the model would choose


def eos_everywhere(tok) -> Engine:
    """An engine whose model puts its weight on the stop id at every position (other ids: 0)."""
    return Engine(ScriptedRunner({}, tok.n_words, tok.eos_id), tok)


def test_min_tokens_holds_back_the_stop_id_where_the_grammar_accepts(llama):
    tok = llama.tokenizer
    digits = Constraint("regex", "[0-9]{1,8}")
    plain, held = generate(eos_everywhere(tok), [("x", params(digits, temperature=0, max_gen_len=8)),
                                                 ("x", params(digits, temperature=0, max_gen_len=8, min_tokens=3))])
    assert len(plain.tokens) == 1 and len(held.tokens) == 3 and held.stop_token == tok.eos_id
    assert re.fullmatch("[0-9]{3}", held.text)


def test_min_tokens_never_leaves_no_token(llama):
    """A grammar whose only allowed token is a stop id (here: one of stop_token_ids) ends the
    text with it before min_tokens; a grammar complete before min_tokens ends it too."""
    engine = eos_everywhere(llama.tokenizer)
    a, = engine.vocabulary.ll.tokenize_str("a")  # the one token that makes the text "a"
    only_a = params(Constraint("choice", ["a"]), temperature=0, stop_token_ids=(a,), min_tokens=2, max_gen_len=8)
    choice = params(Constraint("choice", CHOICES), min_tokens=5, max_gen_len=8)
    stopped, complete = generate(engine, [("x", only_a), ("x", choice)])
    assert stopped.tokens == [] and stopped.stop_token == a and stopped.finish_reason == "stop"
    assert complete.text in CHOICES and complete.finish_reason == "stop" and len(complete.tokens) < 5


def test_n_choices_each_with_its_own_matcher(engine):
    body = {"prompt": "He said", "n": 8, "seed": 11, "temperature": 1.0, "top_p": 1.0, "max_tokens": 20,
            "guided_choice": CHOICES}
    req = openai_api.parse("completions", body, "llama", Limits(), Defaults())
    prompts = api.sequences(req, engine.tokenizer, engine.max_seq_len, Limits(), Defaults())
    seqs = [engine.add(tokens, p) for tokens, p in prompts]
    while engine.running:
        engine.step()
    assert len({id(seq.matcher) for seq in seqs}) == 8
    texts = [seq.text for seq in seqs]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1, texts


def test_seeded_answers_do_not_depend_on_the_batch(llama):
    request = (PROMPT, params(Constraint("json_schema", SCHEMAS["tuple"]), seed=5))
    alone, = generate(Engine(llama.runner, llama.tokenizer), [request])
    others = [("Call me at", params(Constraint("regex", REGEXES[2]), seed=seed)) for seed in range(3)]
    batched = generate(Engine(llama.runner, llama.tokenizer), others[:2] + [request] + others[2:])[2]
    assert batched.tokens == alone.tokens and batched.text == alone.text


def test_prefix_caching_keeps_the_answer(engine):
    request = ("Call me at " * 8, params(Constraint("regex", REGEXES[2]), seed=2))
    first, = generate(engine, [request])
    again, = generate(engine, [request])
    assert engine.pool.hits > 0 and again.tokens == first.tokens


def test_preemption_keeps_the_grammar(monkeypatch):
    """A pool of 9 blocks of 16 tokens for four constrained sequences: some are preempted
    (their matchers keep what they consumed) and recomputed; each gets the tokens it gets
    alone, up to a near tie, and they match their pattern. A near tie: the draw that parts
    them fell within CDF_TIE of a step of the alone run's CDF (recomputing a prompt rounds
    its logits otherwise than decoding did: seed 3 drew 1.2e-8 from one on an AMD CPU, where
    the batch moved that step by 8e-8)."""
    draws = {}  # each draw's key: its distance to the nearest step of its CDF, as a fraction of the mass
    inverse_cdf = sampler.inverse_cdf

    def measured(scaled, keys):
        tokens = inverse_cdf(scaled, keys)
        cdf = (scaled.double() - scaled.amax(-1, keepdim=True)).exp().cumsum(-1)
        cdf = cdf / cdf[:, -1:]
        drawn = sampler.uniforms(keys)[:, 0].tolist()
        for row, (key, token, u) in enumerate(zip(keys.tolist(), tokens.tolist(), drawn)):
            low = cdf[row, token - 1].item() if token else 0.0
            draws[tuple(key)] = min(abs(u - low), abs(cdf[row, token].item() - u))
        return tokens

    monkeypatch.setattr(sampler, "inverse_cdf", measured)
    llama = llama2.tp_llama(None, DEMO, None, 1, max_batch_size=4, max_seq_len=128)
    llama.runner.allocate(num_blocks=9)
    pattern = "[a-z ]{10,80}"
    requests = [(f"Story {i}: " + "once upon a time " * (2 + i), params(Constraint("regex", pattern), max_gen_len=24,
                                                                         seed=i)) for i in range(4)]
    alone, alone_draws = [], []
    for r in requests:
        draws.clear()
        alone += generate(Engine(llama.runner, llama.tokenizer, prefix_caching=False), [r])
        alone_draws.append(list(draws.values()))  # one a token, in order
    engine = Engine(llama.runner, llama.tokenizer, max_seqs=4, prefix_caching=False)
    seqs = generate(engine, requests)
    assert engine.scheduler.preemptions > 0
    for seq, want, margins in zip(seqs, alone, alone_draws):
        parted = parting(seq.tokens, want.tokens)
        assert seq.tokens == want.tokens if parted is None else margins[parted] < CDF_TIE, (parted, margins)
    assert all(re.fullmatch("[a-z ]+", s.text) for s in seqs)  # max_gen_len ends them inside the pattern


CDF_TIE = 1e-6  # where fp32 rounding of the logits can move a step of the CDF (8e-8 seen)


# A schema whose pattern needs more lexer states than small_lexer allows: its grammar breaks
# in the string, mid-answer, as a parser limit does (llguidance then allows stop ids alone)
BREAKS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "s": {"type": "string", "pattern": "^(a|b)*a(a|b){14}$"}},
          "required": ["n", "s"], "additionalProperties": False}


@pytest.fixture
def small_lexer(monkeypatch):
    monkeypatch.setattr(structured, "compiled", structured.GrammarCache())  # grammars compiled meanwhile are the small lexer's
    monkeypatch.setattr(structured, "LIMITS", LLParserLimits(max_lexer_states=50, verbose_errors=False))


def test_a_grammar_that_breaks_mid_answer_ends_with_error(engine, small_lexer):
    seq, = generate(engine, [(PROMPT, params(Constraint("json_schema", BREAKS), seed=0))])
    assert seq.finish_reason == "error" and seq.matcher.error(), seq.text
    assert seq.stop_token in engine.tokenizer.stop_ids and seq.text.startswith('{"n": ')  # cut inside it
    with pytest.raises(json.JSONDecodeError):
        json.loads(seq.text)


def test_a_token_the_grammar_refuses_ends_with_error(engine):
    tok = engine.tokenizer
    seq = engine.add(tok.encode("Digits:", bos=True, eos=False), params(Constraint("regex", "[0-9]+")))
    seven, = engine.vocabulary.ll.tokenize_str("7")
    seq.append(seven, grammar=seq.grammar_verdict(seven))
    assert not seq.done
    x = engine.vocabulary.ll.tokenize_str("x")[0]
    seq.append(x, grammar=seq.grammar_verdict(x))
    assert seq.finish_reason == "error" and seq.matcher.error()
    engine.release(seq)


BROKEN = "the answer broke off after \\d+ tokens: its constraint failed \\(lexer error: too many states: 50 >= 50\\); "
FAILED_BY_API = [  # (route, body, what the client sees: in each API's own shape)
    ("", {"prompt": PROMPT, "structured_outputs": {"json": BREAKS}}, "native"),
    ("v1/completions", {"prompt": PROMPT, "guided_json": BREAKS, "stream": True}, "completions stream"),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                             "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": BREAKS}}},
     "chat"),
    ("v1/responses", {"input": PROMPT, "text": {"format": {"type": "json_schema", "name": "b", "schema": BREAKS}}},
     "responses"),
    ("v1/responses", {"input": PROMPT, "stream": True,
                      "text": {"format": {"type": "json_schema", "name": "b", "schema": BREAKS}}}, "responses stream"),
    ("v1/messages", {"model": "llama", "max_tokens": 100, "messages": [{"role": "user", "content": PROMPT}],
                     "output_config": {"format": {"type": "json_schema", "schema": BREAKS}}}, "messages"),
    ("v1/messages", {"model": "llama", "max_tokens": 100, "messages": [{"role": "user", "content": PROMPT}],
                     "stream": True, "output_config": {"format": {"type": "json_schema", "schema": BREAKS}}},
     "messages stream"),
]


@pytest.mark.parametrize("path, body, seen", FAILED_BY_API, ids=[case[2] for case in FAILED_BY_API])
def test_a_broken_grammar_is_an_error_the_client_sees_and_the_log_has_once(engine, small_lexer, caplog, path, body,
                                                                            seen):
    """finish_reason "error" where a choice can say it (native, OpenAI's completions and chat);
    a 500, or the stream's error event, in the Responses and Messages APIs, which cannot."""
    requests = InFlight(engine, Limits(), Defaults(), "llama")
    spec = read_now(requests, "rq-1", path, json.dumps(body | {"seed": 1, "temperature": 1.0}).encode())
    requests.admit("rq-1", spec, http=True)
    messages = []
    while not messages or messages[-1].kind == "chunk":
        engine.run(1)
        messages += [m] if (m := requests.message(requests.jobs["rq-1"])) is not None else []
    requests.forget("rq-1")
    text = "".join(m.body for m in messages)
    last = messages[-1]
    if seen == "native":
        assert last.status == 200 and json.loads(text)["finish_reason"] == "error"
    elif seen == "completions stream":
        chunks = [json.loads(line.removeprefix("data: ")) for line in text.split("\n\n") if line.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "error"
    elif seen == "chat":
        assert json.loads(text)["choices"][0]["finish_reason"] == "error"
    elif seen in ("responses", "messages"):
        error = json.loads(text)["error"]
        assert last.status == 500 and re.fullmatch(BROKEN + "the server's log has it under request id rq-1",
                                                   error["message"]), error
    else:
        name, data = last.body.strip().split("\n")[-2:]
        data = json.loads(data.removeprefix("data: "))
        error = data["response"]["error"] if seen == "responses stream" else data["error"]
        assert name == ("event: response.failed" if seen == "responses stream" else "event: error"), last.body
        assert re.match(BROKEN, error["message"]), error
    logged = [r.getMessage() for r in caplog.records if "grammar broke" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("request rq-1: sequence 0's grammar broke after"), logged


@pytest.mark.slow  # torchrun ranks
def test_tp2_ranks_agree(llama, tmp_path):
    """At TP=2 rank 0 alone compiles grammars and computes masks, and sends with each token
    what it did to the grammar, so the ranks end the same sequences at the same step with
    the same text, and greedy answers equal TP=1's."""
    tp2, other = (rank["constrained"] for rank in run("engine_worker.py", 2, tmp_path, DEMO, "constrained"))
    tp1 = constrained(llama)
    assert (tp2.pop("matchers"), tp2.pop("compiled")) == (8, 4) and (other.pop("matchers"), other.pop("compiled")) == (0, 0)
    assert tp2 == other
    for key in ("tokens", "texts", "finish_reasons"):
        assert [v for v, greedy in zip(tp2[key], tp1["greedy"]) if greedy] == \
            [v for v, greedy in zip(tp1[key], tp1["greedy"]) if greedy], key
    each = [c for c in CONSTRAINTS for _ in range(2)]  # greedy, then seeded
    for constraint, text, reason in zip(each, tp2["texts"], tp2["finish_reasons"]):
        if constraint is not None and reason == "stop":
            check(constraint, text)
    assert tp2["finish_reasons"].count("stop") >= 6, tp2


# --- the requests ---------------------------------------------------------------------------------

SCHEMA = SCHEMAS["enum"]
ASKED = [  # (route, body fields, the constraint)
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     Constraint("json_schema", SCHEMA)),
    ("chat", {"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ("chat", {"response_format": {"type": "text"}}, None),
    ("completions", {}, None),
    ("completions", {"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", SCHEMA)),
    ("completions", {"structured_outputs": {"regex": "[0-9]+", "choice": None}}, Constraint("regex", "[0-9]+")),
    ("chat", {"structured_outputs": {"choice": CHOICES}}, Constraint("choice", CHOICES)),
    ("chat", {"structured_outputs": {"grammar": LARK}}, Constraint("grammar", LARK)),
    ("completions", {"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA))),
    ("completions", {"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
    ("chat", {"guided_choice": CHOICES}, Constraint("choice", CHOICES)),
    ("completions", {"guided_grammar": LARK, "response_format": {"type": "text"}}, Constraint("grammar", LARK)),
    ("native", {"structured_outputs": {"choice": CHOICES}}, Constraint("choice", CHOICES)),
    ("native", {}, None),
]


def parse(route: str, fields: dict, matcher):
    """The request as the server reads it: parsed, then its constraint compiled."""
    if route == "native":
        req = native_api.parse({"prompt": "Hi"} | fields, Limits(), Defaults())
    else:
        inputs = {"messages": [{"role": "user", "content": "Hi"}]} if route == "chat" else {"prompt": "Hi"}
        req = openai_api.parse(route, inputs | fields, "llama", Limits(), Defaults())
    constraint_fields.compile_constraints(req, matcher)
    return req


@pytest.mark.parametrize("route, fields, constraint", ASKED)
def test_fields_give_the_constraint(engine, route, fields, constraint):
    req = parse(route, fields, engine.matcher)
    assert req.sampling["constraint"] == constraint
    prompts = api.sequences(req, engine.tokenizer, engine.max_seq_len, Limits(), Defaults())
    assert all(p.constraint == constraint for _, p in prompts)


REFUSED = [  # (route, body fields, param, what the message says)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}},
     "response_format", r"^response_format\.json_schema\.schema is not a JSON schema that can be enforced: Invalid type: strin"),
    ("completions", {"guided_regex": "(ab"}, "guided_regex",
     r"^guided_regex is not a valid regular expression: .*unclosed group"),
    ("chat", {"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs",
     r"^structured_outputs\.grammar is not a valid grammar: .*unknown name"),
    ("completions", {"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 2}}},
     "structured_outputs", r"^structured_outputs\.json is not a JSON schema that can be enforced: .*minimum .* greater than maximum"),
    ("completions", {"guided_json": "{not json"}, "guided_json", r"^guided_json is not a JSON schema that can be enforced: not JSON"),
    ("chat", {"guided_choice": []}, "guided_choice",
     r"^guided_choice is not a valid list of choices: expected a non-empty list of strings$"),
    ("chat", {"guided_regex": 5}, "guided_regex",
     r"^guided_regex is not a valid regular expression: expected a string$"),
    ("native", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs",
     r"^structured_outputs\.regex is not a valid regular expression: .*unclosed character class"),
    ("completions", {"response_format": {"type": "json_object"}, "guided_regex": "a",
                     "structured_outputs": {"choice": ["a"]}},
     "response_format", r"^response_format, structured_outputs, guided_regex each constrain the output; give at most"),
    ("native", {"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs",
     r"exactly one of json, regex, choice, grammar, got json, regex$"),
    ("chat", {"structured_outputs": {"yaml": "a: 1"}}, "structured_outputs", r"exactly one of .*, got yaml$"),
    ("chat", {"structured_outputs": "json"}, "structured_outputs", r"must be an object with exactly one of"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", r"type is text, json_object, json_schema$"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
     r"must be an object with the schema"),
    ("native", {"guided_regex": "a"}, "guided_regex", r"unknown fields \['guided_regex'\]"),
    ("chat", {"guided_choice": [str(i) for i in range(4097)]}, "guided_choice",
     r"^guided_choice is not a valid list of choices: 4097 choices, more than the 4096 this server compiles$"),
    ("completions", {"guided_regex": "a" * 70000}, "guided_regex",
     r"^guided_regex is not a valid regular expression: 70000 bytes, more than the 65536 this server compiles$"),
]


@pytest.mark.parametrize("route, fields, param, message", REFUSED)
def test_what_is_refused_names_the_field(engine, route, fields, param, message):
    with pytest.raises(RequestError) as e:
        parse(route, fields, engine.matcher)
    error = e.value
    assert error.status == 400 and error.param == param and re.search(message, error.message, re.S), error.message


def test_rank0_answers_a_bad_constraint_itself(engine):
    """InFlight.read (rank 0) answers what cannot compile with a 400: no job, nothing queued."""
    requests = InFlight(engine, Limits(), Defaults(), "llama")
    body = {"messages": [{"role": "user", "content": "Hi"}], "guided_regex": "(ab"}
    message = read_now(requests, "1", "v1/chat/completions", json.dumps(body).encode())
    error = json.loads(message.body)["error"]
    assert message.status == 400 and error["param"] == "guided_regex" and "unclosed group" in error["message"]
    spec = read_now(requests, "2", "v1/chat/completions", json.dumps(body | {"guided_regex": "(ab)+"}).encode())
    (_, p), = spec[1]
    assert p.constraint == Constraint("regex", "(ab)+") and not engine.running


def test_grammars_compile_off_the_request_thread(engine, monkeypatch):
    """A request's grammar compiles on the compiler's thread: while it does, read says so
    (None), the other requests are read at once, and the next read gives its job, or its 400;
    a compiling request whose client went away is dropped."""
    release, threads = threading.Event(), []
    real_matcher = engine.matcher

    def slow_matcher(constraint):
        threads.append(threading.current_thread().name)
        release.wait(10)
        return real_matcher(constraint)
    monkeypatch.setattr(engine, "matcher", slow_matcher)
    requests = InFlight(engine, Limits(), Defaults(), "llama")
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    for req_id, regex in (("good", "(ab)+"), ("bad", "(ab"), ("gone", "a+")):
        assert requests.read(req_id, "v1/chat/completions", json.dumps(body | {"guided_regex": regex}).encode()) is None
    assert isinstance(requests.read("plain", "v1/chat/completions", json.dumps(body).encode()), tuple)
    requests.drop_compiles({"good", "bad", "plain"})
    assert set(requests.compiling) == {"good", "bad"}
    release.set()
    (_, params), = read_now(requests, "good", "v1/chat/completions", b"")[1]
    assert params.constraint == Constraint("regex", "(ab)+")
    refused = read_now(requests, "bad", "v1/chat/completions", b"")
    assert refused.status == 400 and json.loads(refused.body)["error"]["param"] == "guided_regex"
    assert threads and all(name.startswith("grammars") for name in threads) and not requests.compiling


# --- over HTTP ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/predictions/llama/1.0/v1", api_key=server.key, max_retries=0)


def test_openai_client(server, client):
    """Through TorchServe (TP=2): a chat answer in a JSON schema (also streamed), a completion
    among choices, and a bad regex refused naming its field; the native API too."""
    schema = SCHEMAS["number_bounds"]
    messages = [{"role": "user", "content": "Give me numbers."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema}}
    replies = [client.chat.completions.create(model="llama", messages=messages, response_format=response_format,
                                              temperature=1.0, seed=seed, max_tokens=300).choices[0]
               for seed in range(2)]
    for reply in replies:
        assert reply.finish_reason == "stop"
        jsonschema.validate(json.loads(reply.message.content), schema)
    chunks = client.chat.completions.create(model="llama", messages=messages, response_format=response_format,
                                            temperature=1.0, seed=0, max_tokens=300, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == replies[0].message.content
    completion = client.completions.create(model="llama", prompt="He said", n=3, seed=1, max_tokens=20, top_p=1.0,
                                           extra_body={"guided_choice": CHOICES})
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in completion.choices)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llama", prompt="Hi", extra_body={"guided_regex": "(ab"})
    assert e.value.body["param"] == "guided_regex" and "unclosed group" in e.value.body["message"]
    native = server.generate({"prompt": "He said", "structured_outputs": {"regex": "(yes|no)!"}, "seed": 2})
    assert native["generation"] in ("yes!", "no!") and native["finish_reason"] == "stop"


def test_the_grammar_cache_is_bounded_in_bytes(llama):
    """Compiled grammars are kept by their text, the least recently used dropped first once
    their texts pass the cache's bytes (or entries)."""
    ll = structured.vocabulary(llama.tokenizer, llama.runner.vocab_size).ll
    grammars = [LLMatcher.grammar_from_regex(f"[0-9]{{{n}}}" + "x" * 400) for n in range(1, 7)]
    cache = structured.GrammarCache(entries=8, max_bytes=3 * len(grammars[0]))
    first = cache(ll, grammars[0])
    assert cache(ll, grammars[0]) is first  # kept
    for grammar in grammars[1:]:
        cache(ll, grammar)
    assert cache.bytes <= cache.max_bytes and len(cache.kept) == 3
    assert (id(ll), grammars[-1]) in cache.kept and (id(ll), grammars[0]) not in cache.kept
    many = structured.GrammarCache(entries=2, max_bytes=1 << 20)
    for grammar in grammars:
        many(ll, grammar)
    assert [g for _, g in many.kept] == grammars[-2:]
