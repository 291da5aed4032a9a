"""The archive as users meet it: a real TorchServe (TP=2 on CPU) over HTTP and gRPC,
checked against the same model run in this process."""

import json
import os
import re
import subprocess
import sys
import zipfile

import grpc
import pytest


GREEDY = {"temperature": 0, "max_new_tokens": 24}
PROMPTS = ["The secret of a happy life is", "Once upon a time"]
DIALOG = [{"role": "system", "content": "You are a cheerful assistant."},
          {"role": "user", "content": "What should I do on a rainy day?"}]


def test_text_matches_in_process(server, demo_llama):
    answers = server.generate({"prompt": PROMPTS} | GREEDY)
    expected = demo_llama.text_completion(PROMPTS, 24, temperature=0)
    assert answers == expected
    assert all(a["generation"].strip() for a in answers)


def test_single_prompt_gives_one_answer(server, demo_llama):
    answer = server.generate({"prompt": PROMPTS[0]} | GREEDY)
    expected = demo_llama.text_completion(PROMPTS[:1], 24, temperature=0)[0]
    assert answer == expected
    assert set(answer) == {"generation", "finish_reason", "usage"}


def test_chat_matches_in_process(server, demo_llama):
    answer = server.generate({"dialog": DIALOG} | GREEDY)
    expected = demo_llama.chat_completion([DIALOG], 24, temperature=0)[0]
    assert answer == expected
    assert answer["generation"]["role"] == "assistant"
    assert server.generate({"messages": DIALOG} | GREEDY) == answer


def test_logprobs_and_echo(server, demo_llama):
    body = {"prompt": PROMPTS[1], "logprobs": True, "echo": True} | GREEDY
    answer = server.generate(body)
    expected = demo_llama.text_completion(PROMPTS[1:], 24, temperature=0,
                                        logprobs=True, echo=True)[0]
    assert answer["generation"] == expected["generation"]
    assert answer["generation"].startswith(PROMPTS[1])
    assert answer["tokens"] == expected["tokens"]
    assert len(answer["logprobs"]) == len(answer["tokens"])
    assert answer["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-3)


def test_sampling_with_seed_reproduces(server):
    body = {"prompt": PROMPTS[0], "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7, "max_new_tokens": 24}
    first = server.generate(body)
    assert server.generate(body) == first
    others = [server.generate(body | {"seed": s})["generation"] for s in (8, 9, 10)]
    assert any(o != first["generation"] for o in others)


def test_stop_string_cuts(server, demo_llama):
    """The answer is cut before the stop string, and it ended in the step that completed
    the stop string, although a TorchServe iteration may run several steps: its usage is the
    in-process engine's, which checks after every token."""
    full = server.generate({"prompt": PROMPTS[0]} | GREEDY)["generation"]
    stop = full.split()[3]  # a word the greedy answer contains
    answer = server.generate({"prompt": PROMPTS[0], "stop": [stop]} | GREEDY)
    assert answer["finish_reason"] == "stop"
    assert answer["generation"] == full[:full.index(stop)]
    assert answer == demo_llama.text_completion(PROMPTS[:1], GREEDY["max_new_tokens"], temperature=0, stop=[stop])[0]


@pytest.mark.parametrize("body", [{"prompt": PROMPTS[0]}, {"dialog": DIALOG}], ids=["text", "chat"])
def test_streaming_adds_up_to_the_answer(server, body):
    whole = server.generate(body | GREEDY)
    chunks = server.stream(body | GREEDY)
    assert len(chunks) > 2
    text = "".join(c["text"] for c in chunks)
    generation = whole["generation"]
    assert text == (generation["content"] if "dialog" in body else generation)
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
    assert all("finish_reason" not in c for c in chunks[:-1])


def test_stream_of_a_list_of_prompts(server):
    """Each line names its prompt (index); each prompt's lines add up to its answer."""
    body = {"prompt": PROMPTS} | GREEDY
    whole = server.generate(body)
    lines = server.stream(body)
    assert all(set(line) >= {"index", "text"} for line in lines)
    assert {line["index"] for line in lines} == {0, 1}
    for i, answer in enumerate(whole):
        own = [line for line in lines if line["index"] == i]
        assert "".join(line["text"] for line in own) == answer["generation"]
        assert own[-1]["finish_reason"] == answer["finish_reason"] and own[-1]["usage"] == answer["usage"]
        assert all("finish_reason" not in line for line in own[:-1])


def test_stream_with_echo(server):
    body = {"prompt": PROMPTS[1], "echo": True} | GREEDY
    whole = server.generate(body)
    chunks = server.stream(body)
    assert chunks[0]["text"].startswith(PROMPTS[1]) and len(chunks) > 2
    assert "".join(c["text"] for c in chunks) == whole["generation"]


def test_stop_string_streamed(server):
    """A stop string of two words: the first word, which might begin it, is held back, so the
    streamed text is the cut answer, never more."""
    full = server.generate({"prompt": PROMPTS[0]} | GREEDY)["generation"]
    words = list(re.finditer(r"\S+", full))
    stop = full[words[3].start():words[4].end()]
    body = {"prompt": PROMPTS[0], "stop": stop} | GREEDY
    chunks = server.stream(body)
    text = "".join(c["text"] for c in chunks)
    assert text == full[:full.index(stop)] == server.generate(body)["generation"]
    assert chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == server.generate(body)["usage"]  # it ended at the same token


def test_stream_of_one_token(server, demo_llama):
    chunks = server.stream({"prompt": PROMPTS[0], "max_new_tokens": 1, "temperature": 0})
    local = demo_llama.text_completion([PROMPTS[0]], 1, temperature=0)[0]
    assert "".join(c["text"] for c in chunks) == local["generation"]
    assert (chunks[-1]["finish_reason"], chunks[-1]["usage"]) == (local["finish_reason"], local["usage"])
    assert local["usage"]["completion_tokens"] == 1


# --- gRPC, with a client generated from the proto inside the installed TorchServe ---------

@pytest.fixture(scope="module")
def grpc_stub(tmp_path_factory):
    import ts

    out = tmp_path_factory.mktemp("grpc")
    jar = os.path.join(os.path.dirname(ts.__file__), "frontend", "model-server.jar")
    with zipfile.ZipFile(jar) as z:
        for name in ("proto/inference.proto", "google/rpc/status.proto"):
            z.extract(name, out)
    import grpc_tools

    includes = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{out}/proto", f"-I{out}", f"-I{includes}",
                    f"--python_out={out}", f"--grpc_python_out={out}", f"{out}/proto/inference.proto",
                    f"{out}/google/rpc/status.proto"], check=True)
    sys.path.insert(0, str(out))
    import inference_pb2
    import inference_pb2_grpc

    return inference_pb2, inference_pb2_grpc


def grpc_call(server, stub_modules, body, method="Predictions", key="default"):
    pb2, pb2_grpc = stub_modules
    key = server.key if key == "default" else key
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb2_grpc.InferenceAPIsServiceStub(channel)
        request = pb2.PredictionsRequest(model_name="llama", input={"data": json.dumps(body).encode()})
        metadata = [("authorization", f"Bearer {key}")] if key else []
        reply = getattr(stub, method)(request, metadata=metadata, timeout=120)
        if method == "Predictions":
            return json.loads(reply.prediction)
        return [json.loads(line) for r in reply for line in r.prediction.decode().splitlines() if line]


def test_grpc_predictions(server, grpc_stub):
    assert grpc_call(server, grpc_stub, {"prompt": PROMPTS} | GREEDY) == server.generate({"prompt": PROMPTS} | GREEDY)
    assert grpc_call(server, grpc_stub, {"dialog": DIALOG} | GREEDY) == server.generate({"dialog": DIALOG} | GREEDY)


def test_grpc_stream_predictions(server, grpc_stub):
    whole = server.generate({"prompt": PROMPTS[1]} | GREEDY)
    chunks = grpc_call(server, grpc_stub, {"prompt": PROMPTS[1], "stream": True} | GREEDY, "StreamPredictions")
    # one message holding all chunks: TorchServe 0.12 cannot keep a gRPC stream open (see handler.py)
    assert len(chunks) >= 2 and "finish_reason" in chunks[-1]
    assert "".join(c["text"] for c in chunks) == whole["generation"]
    assert chunks[-1]["usage"] == whole["usage"]


def test_grpc_bad_request_and_key(server, grpc_stub):
    error = grpc_call(server, grpc_stub, {"prompt": PROMPTS[0], "top_p": 7})
    assert error["code"] == 400 and "top_p" in error["message"]
    chunks = grpc_call(server, grpc_stub, {"prompt": 3, "stream": True}, "StreamPredictions")
    assert chunks[0]["code"] == 400 and "prompt" in chunks[0]["message"]
    with pytest.raises(grpc.RpcError) as e:
        grpc_call(server, grpc_stub, {"prompt": PROMPTS[0]}, key="wrong")
    assert "Token Authorization failed" in e.value.details()


# --- bad input: a 4xx that names the field, and the same worker answers afterwards ---------

LONG = "word " * 600
BAD = [
    (b"{not json", 400, "body", "not valid JSON"),
    (b"\xff\xfe\x00", 400, "body", "UTF-8"),
    (b"", 400, "body", "empty"),
    ([1, 2], 400, "body", "must be a JSON object"),
    ({"max_new_tokens": 5}, 400, "prompt", "exactly one of prompt"),
    ({"prompt": "a", "dialog": DIALOG}, 400, "prompt", "not prompt and dialog"),
    ({"prompt": 5}, 400, "prompt", "prompt must be a string"),
    ({"prompt": []}, 400, "prompt", "non-empty list"),
    ({"prompt": ["a", 3]}, 400, "prompt[1]", "prompt[1] must be a string"),
    ({"prompt": ["a"] * 9}, 400, "prompt", "the limit is"),
    ({"dialog": [{"role": "robot", "content": "hi"}]}, 400, "dialog", "dialog[0].role must be one of"),
    ({"dialog": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400, "dialog", "alternate"),
    ({"dialog": [{"role": "user", "content": "[INST] hi"}]}, 400, "dialog", "special tag [INST]"),
    ({"dialog": [{"role": "user", "content": "<<SYS>>"}]}, 400, "dialog", "special tag <<SYS>>"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages", "messages[0].role"),
    ({"dialog": []}, 400, "dialog", "non-empty"),
    ({"prompt": "a", "max_new_tokens": 0}, 400, "max_new_tokens", "between 1 and 512"),
    ({"prompt": "a", "max_new_tokens": 513}, 400, "max_new_tokens", "between 1 and 512"),
    ({"prompt": "a", "max_new_tokens": "5"}, 400, "max_new_tokens", "must be an integer"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature", "temperature must be in"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature", "finite number"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p", "top_p must be in (0.0"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p", "top_p must be in"),
    ({"prompt": "a", "top_k": -2}, 400, "top_k", "top_k must be between"),
    ({"prompt": "a", "seed": -1}, 400, "seed", "seed must be between"),
    ({"prompt": "a", "stop": [""]}, 400, "stop", "stop must be"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": "a", "max_tokens": 5}, 400, "max_tokens", "unknown fields"),
    ({"dialog": DIALOG, "echo": True}, 400, "echo", "echo is only for text"),
    ({"prompt": LONG}, 400, "prompt", "tokens, the limit is 511"),
    ({"prompt": "word " * 400, "max_new_tokens": 300}, 400, "max_new_tokens", "at most"),
]


@pytest.mark.parametrize("body,status,param,message", BAD, ids=[b[3] for b in BAD])
def test_bad_input(server, body, status, param, message):
    r = server.post(body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["param"] == param and message in error["message"], error


def test_bad_input_streamed(server):
    r = server.post({"prompt": "a", "top_p": 2, "stream": True})
    assert r.status_code == 400 and "top_p" in r.json()["message"]


def test_body_without_json_content_type(server):
    """TorchServe splits a form-encoded body into fields, so no body reaches the handler: 415.
    Other bodies are read as JSON whatever their Content-Type (README: Errors)."""
    r = server.post(json.dumps({"prompt": "a"}), headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["message"]
    r = server.post(json.dumps({"prompt": "a", "max_new_tokens": 2}), headers={"Content-Type": "text/plain"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    r = server.post("<prompt>a</prompt>", headers={"Content-Type": "application/xml"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["message"]


def test_same_workers_answer_after_bad_input(server, demo_llama):
    """Bad requests of several kinds each get their 4xx, on the same two workers, which then
    answer right (the suite's other tests send more before this one when run together)."""
    for raw, path in ((b"{not json", ""), (b'{"prompt": 5}', ""), (b'{"prompt": "a", "max_new_tokens": -1}', ""),
                      (b'{"dialog": [{"role": "robot", "content": "hi"}]}', ""), (b"\xff\xfe", "/1.0/v1/completions"),
                      (b'{"prompt": "a"}', "/1.0/v1/nothing")):
        r = server.post(raw, path)
        assert 400 <= r.status_code < 500, (raw, path, r.status_code, r.text)
    assert server.worker_pids() == server.initial_pids and len(server.initial_pids) == 2
    test_text_matches_in_process(server, demo_llama)


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_inference_key_required(server, key):
    r = server.post({"prompt": "a"}, key=key)
    # TorchServe 0.12.0's frontend answers a failed token check with 400 (its InvalidKeyException)
    assert r.status_code in (400, 401) and "Token Authorization failed" in r.text
