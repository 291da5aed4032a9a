"""A real model: SmolLM2-135M-Instruct from its GGUF file (make smollm2), against transformers'
own GGUF loader in fp32, in-process at TP=1 and through TorchServe at TP=3 (its 9 heads and 3
KV heads over 3 ranks): prompt logits, greedy chat answers, answers that a JSON schema shapes
and that are right (not only valid), a forced tool call, tools its template never shows, and
prompt lookup on a prompt that asks for a text back."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

import chat_format
from conftest import ROOT, gguf_parsed_once
from engine import Engine
from llama2 import tp_llama
from local_server import start_server
from sequence import SamplingParams
from speculative import NgramProposer, Speculation

pytestmark = pytest.mark.slow  # transformers' model, servers at TP=3

SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity in one sentence.",
             "What is 12 times 12?", "Name three primary colors.", "Translate 'good morning' into Spanish.",
             "Who wrote Romeo and Juliet?", "Give me a synonym for happy."]
NEW_TOKENS = 32
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40}}}
EXTRACTIONS = ["Extract the person's name, age and city as JSON: Alice Moreau is 31 and lives in Lyon.",
               "Alice Moreau is 31 and lives in Lyon. Give her name, age and city in JSON."]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer and model from the GGUF file (its own loader, fp32)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    assert os.path.isfile(SMOLLM2), f"{SMOLLM2} is missing: make smollm2"
    folder, name = os.path.split(SMOLLM2)
    with gguf_parsed_once():
        return (AutoTokenizer.from_pretrained(folder, gguf_file=name),
                LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def expected(reference):
    """transformers' greedy answer to each question (NEW_TOKENS at most, the stop token left out)."""
    tok, model = reference
    answers = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        answers.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


@pytest.fixture(scope="module")
def ours():
    return tp_llama(None, SMOLLM2, SMOLLM2, 1, max_batch_size=8, max_seq_len=512)


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    """TorchServe serving the file in place at TP=3, one thread per rank."""
    yield from served(tmp_path_factory, tp=3, threads=1)


def served(tmp_path_factory, tp: int, threads: int):
    srv = start_server(tmp_path_factory.mktemp("smollm2"), None, tp=tp, batch_size=8, threads=threads,
                       handler={"checkpoint": SMOLLM2, "tokenizer": SMOLLM2, "max_seq_len": 512})
    yield openai.OpenAI(base_url=f"{srv.url}/predictions/llama/1.0/v1", api_key=srv.key, max_retries=0)
    srv.stop(wait=False)


def prompt_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)


# --- TP=1, in-process -------------------------------------------------------------------------

def test_prompt_logits_equal_transformers(ours, reference):
    """Chat prompts and prompts of random ids: the largest difference at most 1e-4 of the logits' spread."""
    _, model = reference
    prompts = [chat_format.encode_dialog(ours.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    prompts += [torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 48)]
    for tokens in prompts:
        with torch.no_grad():
            want = model(torch.tensor([tokens])).logits
        got = ours.model(torch.tensor([tokens]), 0)
        assert (got - want).abs().max().item() <= 1e-4 * (want.max() - want.min()).item(), len(tokens)


def test_greedy_chat_equals_transformers(ours, expected):
    answers = ours.chat_completion([[{"role": "user", "content": q}] for q in QUESTIONS], NEW_TOKENS, temperature=0)
    assert [a["generation"]["content"] for a in answers] == expected


def test_prompt_lookup_doubles_up_on_a_text_asked_back(ours):
    """A prompt that asks for a passage again: prompt lookup's proposals are mostly accepted,
    and the greedy tokens are those of plain decoding."""
    passage = ("The lighthouse keeper climbed the stairs every evening, lit the great lamp, and watched the ships "
               "pass safely along the rocky coast until morning came.")
    prompt = chat_format.encode_dialog(ours.tokenizer, [{"role": "user", "content": f"Repeat this text exactly: {passage}"}])

    def decode(speculation):
        engine = Engine(ours.runner, ours.tokenizer, speculation=speculation)
        seq = engine.add(prompt, SamplingParams(max_gen_len=40, temperature=0))
        while engine.running:
            engine.step()
        return seq.tokens

    spec = Speculation(NgramProposer(), 4, max_batch=2, max_seq_len=ours.runner.max_seq_len)
    assert decode(spec) == decode(None)
    assert spec.accepted > 0.5 * spec.proposed > 0, (spec.accepted, spec.proposed)


# --- TP=3, through TorchServe ----------------------------------------------------------------

def test_served_at_tp3_greedy_chat_equals_transformers(smollm2_server, expected):
    assert_greedy_chat(smollm2_server, expected)


def test_served_at_tp1_greedy_chat_equals_transformers(tmp_path_factory, expected):
    """As make serve serves it by default: TP=1, the cores' threads."""
    for client in served(tmp_path_factory, tp=1, threads=2):
        assert_greedy_chat(client, expected)


def assert_greedy_chat(client, expected: list[str]):
    """The questions asked at once, as clients do: the server decodes them together."""
    def ask(question: str) -> str:
        reply = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": question}],
                                               max_tokens=NEW_TOKENS, temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        assert list(pool.map(ask, QUESTIONS)) == expected


def test_served_at_tp3_prompt_logprobs_equal_transformers(smollm2_server, reference):
    """The prompt's logprobs (echo) at TP=3 against transformers' log-softmax: within 1e-4 of
    the logits' spread."""
    tok, model = reference
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    scored = smollm2_server.completions.create(model="llama", prompt=text, max_tokens=1, temperature=0, echo=True, logprobs=0)
    tokens = tok(text).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    want = torch.log_softmax(logits.double(), -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    got = torch.tensor(scored.choices[0].logprobs.token_logprobs[1:len(tokens)], dtype=torch.float64)
    assert (got - want).abs().max().item() <= 1e-4 * (logits.max() - logits.min()).item()


def test_served_at_tp3_extraction_is_right(smollm2_server):
    for text in EXTRACTIONS:
        reply = smollm2_server.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        person = json.loads(reply.choices[0].message.content)
        jsonschema.validate(person, PERSON)
        assert person == {"name": "Alice Moreau", "age": 31, "city": "Lyon"}, text


def test_served_at_tp3_a_forced_tool_call_names_the_city(smollm2_server):
    reply = smollm2_server.chat.completions.create(model="llama", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                        tools=[WEATHER], tool_choice="required", temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_served_at_tp3_tools_its_template_never_shows_leave_a_text_answer(smollm2_server):
    """SmolLM2's template reads no `tools`: with tool_choice auto the prompt is the one without
    tools (as transformers renders it), and the model answers in text instead of degenerating."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools = smollm2_server.chat.completions.create(model="llama", messages=messages, tools=[WEATHER], temperature=0,
                                             max_tokens=NEW_TOKENS)
    without = smollm2_server.chat.completions.create(model="llama", messages=messages, temperature=0, max_tokens=NEW_TOKENS)
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens
    assert with_tools.choices[0].message.content == without.choices[0].message.content
    assert not with_tools.choices[0].message.tool_calls and "A:" not in with_tools.choices[0].message.content
