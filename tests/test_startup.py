"""Starting a server as users do, with `make serve` (on private ports, in a folder of its own):
what cannot load is refused in seconds with one line naming the problem, before TorchServe
starts (tools/configure.py) or, for what only loading finds, as soon as a worker fails
(tools/wait_ready.py), leaving no TorchServe behind; loading shows each rank's stages; and the
configuration keys do what README.md says, left out or set."""

import dataclasses
import json
import os
import random
import re
import shutil
import time
import zipfile

import psutil
import pytest
import sentencepiece
import torch
import yaml
from safetensors.torch import save_file

import configure
import wait_ready
from conftest import DEMO, ROOT, configure_line
from local_server import Server, free_port
from serving_config import ServingConfig
from tokenizer import Tokenizer

DEMO_VOCAB = 4096  # demo/params.json

# settings the handler refuses (serving_config): make serve's SET, and the refusal's words
BAD_SETTINGS = {
    "overlap maybe": ("handler.overlap=maybe", ["handler.overlap must be auto, true or false, got 'maybe'"]),
    "unknown key": ("handler.overlapp=true", ["unknown keys in the handler section of model-config.yaml: "
                                              "handler.overlapp (the keys are checkpoint,"]),
    "wrong type": ("handler.max_seq_len=abc", ["handler.max_seq_len must be a whole number >= 1, got 'abc'"]),
    "fp8 on cpu": ("handler.quantization=fp8", ["fp8 quantization needs a CUDA GPU", "runs on cpu"]),
    "kv share on cpu": ("handler.kv_cache_memory=0.9", ["handler.kv_cache_memory 0.9 is a share of a GPU's free "
                                                        "memory", "runs on the CPU"]),
}


def base_config() -> dict:
    with open(os.path.join(ROOT, "model-config.yaml")) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> str:
    """A 300-token sentencepiece model trained here on README.md: another vocabulary."""
    out = tmp_path_factory.mktemp("tokenizer")
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(out / "small"),
                                             vocab_size=300, minloglevel=2)
    path = str(out / "small.model")
    assert Tokenizer(path).n_words == 300
    return path


def meta_folder(path, tokenizer: str = os.path.join(DEMO, "tokenizer.model"), shards: tuple = (0,),
                **params) -> str:
    """A Meta-layout folder with these params and empty (but whole) consolidated.NN.pth files."""
    os.makedirs(path)
    params = {"dim": 256, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "vocab_size": DEMO_VOCAB,
              "multiple_of": 256, "norm_eps": 1e-5} | params
    with open(os.path.join(path, "params.json"), "w") as f:
        json.dump(params, f)
    for i in shards:
        torch.save({}, os.path.join(path, f"consolidated.{i:02d}.pth"))
    shutil.copy(tokenizer, os.path.join(path, "tokenizer.model"))
    return str(path)


def hf_folder(path, **config) -> str:
    """A Hugging Face-layout folder with this config.json and one small safetensors file."""
    os.makedirs(path)
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 128, "vocab_size": DEMO_VOCAB,
              "max_position_embeddings": 2048} | config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({"model.norm.weight": torch.ones(64)}, os.path.join(path, "model.safetensors"))
    shutil.copy(os.path.join(DEMO, "tokenizer.model"), os.path.join(path, "tokenizer.model"))
    return str(path)


def truncate(path: str):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def demo_copy(path, truncated: bool = False) -> str:
    shutil.copytree(DEMO, path)
    if truncated:
        truncate(os.path.join(path, "consolidated.00.pth"))
    return str(path)


def refusal(config: dict, weights: str | None = None) -> str:
    with pytest.raises(ValueError) as e:
        configure.check(config, weights)
    return str(e.value)


# --- 1. refused before TorchServe starts: configure.check, in this process ----------------------

def test_check_passes_what_loads(tmp_path):
    assert configure.check(configure.configure(base_config(), tp=2, device="cpu"), DEMO).startswith("checked")
    assert configure.check(configure.configure(base_config(), tp=8, device="cpu"), DEMO)  # 4 KV heads shared
    padded = hf_folder(tmp_path / "padded", vocab_size=DEMO_VOCAB + 64)  # padding rows, as some HF models have
    assert configure.check(configure.configure(base_config(), tp=8, checkpoint=padded, device="cpu"))


def test_compiling_gives_the_worker_time_to_start(tmp_path, monkeypatch, capsys):
    """With handler.compile (an argument, or SET as `make serve` passes it), startupTimeout is at
    least COMPILE_STARTUP_TIMEOUT: a first compile outlasts TorchServe's 600 s; without, it stays."""
    assert configure.configure(base_config(), device="cpu")["startupTimeout"] == 600
    assert configure.configure(base_config(), device="cpu", handler={"compile": True})["startupTimeout"] == 1800
    written = tmp_path / "build" / "model-config.yaml"
    configure_line(DEMO, tmp_path, monkeypatch, capsys, "--set", "handler.compile=true")
    assert yaml.safe_load(written.read_text())["startupTimeout"] == configure.COMPILE_STARTUP_TIMEOUT
    configure_line(DEMO, tmp_path, monkeypatch, capsys, "--set", "handler.compile=true", "--set", "startupTimeout=3600")
    assert yaml.safe_load(written.read_text())["startupTimeout"] == 3600


def test_check_refuses_missing_and_unknown_folders(tmp_path):
    missing = str(tmp_path / "nowhere")
    message = refusal(configure.configure(base_config(), checkpoint=missing, device="cpu"))
    assert message == f"checkpoint folder not found: {missing}"
    os.makedirs(tmp_path / "empty")
    message = refusal(configure.configure(base_config(), checkpoint=str(tmp_path / "empty"), device="cpu"))
    assert "neither params.json" in message and str(tmp_path / "empty") in message
    gap = meta_folder(tmp_path / "gap", shards=(0, 2))
    message = refusal(configure.configure(base_config(), checkpoint=gap, device="cpu"))
    assert f"missing shard {gap}/consolidated.01.pth" in message


def test_check_refuses_a_missing_tokenizer(tmp_path):
    folder = meta_folder(tmp_path / "ckpt")
    os.remove(os.path.join(folder, "tokenizer.model"))
    message = refusal(configure.configure(base_config(), checkpoint=folder, device="cpu"))
    assert f"no tokenizer.json or tokenizer.model in {folder}" in message


@pytest.mark.parametrize("params, tp, words", [
    ({"dim": 256, "n_heads": 8, "n_kv_heads": 4}, 3, ["TP=3", "8 heads", "n_heads 8 cannot be split over 3"]),
    ({"dim": 768, "n_heads": 12, "n_kv_heads": 6}, 4, ["TP=4", "6 KV heads", "n_kv_heads 6 cannot be split over 4"]),
    ({"dim": 768, "n_heads": 12, "n_kv_heads": 4}, 6, ["TP=6", "4 KV heads", "6 ranks cannot share 4 KV heads"]),
], ids=["heads", "kv-heads", "kv-heads-shared"])
def test_check_refuses_a_tp_that_does_not_divide_the_heads(tmp_path, params, tp, words):
    folder = meta_folder(tmp_path / "ckpt", **params)
    message = refusal(configure.configure(base_config(), tp=tp, checkpoint=folder, device="cpu"))
    assert all(w in message for w in words), message


def test_check_refuses_a_tp_that_does_not_divide_the_ffn(tmp_path):
    folder = hf_folder(tmp_path / "ckpt", intermediate_size=100)
    message = refusal(configure.configure(base_config(), tp=8, checkpoint=folder, device="cpu"))
    assert "TP=8" in message and "FFN width 100 cannot be split over 8 ranks" in message


def test_check_refuses_a_context_beyond_the_models_positions(tmp_path):
    folder = hf_folder(tmp_path / "ckpt", max_position_embeddings=256)
    config = configure.configure(base_config(), checkpoint=folder, device="cpu", handler={"max_seq_len": 257})
    assert "handler.max_seq_len 257 is beyond the 256 positions" in refusal(config)
    config["handler"]["max_seq_len"] = 256
    assert configure.check(config)


@pytest.mark.parametrize("layout", ["meta", "hf"])
def test_check_refuses_a_truncated_weights_file(tmp_path, layout):
    if layout == "meta":
        folder, path = demo_copy(tmp_path / "ckpt"), str(tmp_path / "ckpt" / "consolidated.00.pth")
    else:
        folder = hf_folder(tmp_path / "ckpt")
        path = os.path.join(folder, "model.safetensors")
    config = configure.configure(base_config(), checkpoint=folder, device="cpu")
    assert configure.check(config)  # whole, it passes
    truncate(path)
    message = refusal(config)
    assert path in message and "truncated" in message


def test_check_refuses_a_tokenizer_of_another_vocabulary(tmp_path, small_tokenizer):
    config = configure.configure(base_config(), checkpoint=DEMO, tokenizer=small_tokenizer, device="cpu")
    message = refusal(config)
    assert "300 tokens" in message and f"{DEMO_VOCAB}" in message and small_tokenizer in message
    smaller_model = meta_folder(tmp_path / "ckpt", vocab_size=1000)  # the demo tokenizer has 4096
    message = refusal(configure.configure(base_config(), checkpoint=smaller_model, device="cpu"))
    assert f"{DEMO_VOCAB} tokens" in message and "1000" in message


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_check_refuses_a_setting_the_handler_refuses(case):
    setting, words = BAD_SETTINGS[case]
    config = configure.configure(base_config(), device="cpu")
    configure.set_key(config, setting)
    message = refusal(config, DEMO)
    assert all(w in message for w in words), message


# --- 2. `make serve` on private ports: refusals, a worker that fails, progress ---------------------

def no_torchserve_left(server: Server) -> bool:
    """Neither the frontend nor any process started for this folder is running (waits 10 s)."""
    deadline = time.time() + 10
    while time.time() < deadline:
        left = [p for p in psutil.process_iter(["cmdline"]) if any(server.workdir in part for part in
                                                                     (p.info["cmdline"] or []))]
        if server.frontend() is None and not left:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing folder", "TP=3", "truncated weights", "tokenizer of another vocabulary",
                                  *BAD_SETTINGS])
def test_make_serve_refuses_in_seconds(tmp_path, small_tokenizer, case):
    server = Server(str(tmp_path / "ts"), tp=3 if case == "TP=3" else 2)
    variables, settings = [f"CKPT={DEMO}"], ()  # the demo's 8 heads (make serve's own SmolLM2 has 9)
    if case in BAD_SETTINGS:
        setting, words = BAD_SETTINGS[case]
        settings = (setting,)
    elif case == "missing folder":
        missing = f"{tmp_path}/does-not-exist"
        variables, words = [f"CKPT={missing}"], [f"checkpoint folder not found: {missing}"]
    elif case == "TP=3":
        words = ["TP=3", "8 heads", "cannot be split over 3 ranks"]
    elif case == "truncated weights":
        folder = demo_copy(tmp_path / "ckpt", truncated=True)
        variables, words = [f"CKPT={folder}"], [f"{folder}/consolidated.00.pth is truncated"]
    else:
        folder = demo_copy(tmp_path / "ckpt")
        variables, words = [f"CKPT={folder}", f"TOKENIZER={small_tokenizer}"], ["300 tokens", f"{DEMO_VOCAB}"]
    try:
        status, output, _ = server.make_serve(*variables, settings=settings, timeout=120)
        assert status != 0, (status, output[-2000:])
        refusal = [line for line in output.splitlines() if line.startswith("cannot serve: ")]
        assert refusal and all(w in refusal[0] for w in words), output[-2000:]
        assert not os.path.exists(os.path.join(server.workdir, "logs")), "TorchServe was started"
        assert no_torchserve_left(server)
    finally:
        server.stop()  # should there be one


@pytest.mark.slow
def test_make_serve_stops_a_worker_that_fails_to_load(tmp_path):
    """A tensor of the wrong shape passes the checks (they read no weights): TorchServe starts,
    both ranks fail to load, and `make serve` says where and stops TorchServe, which would
    otherwise retry the worker until startupTimeout (600 s)."""
    folder = demo_copy(tmp_path / "ckpt")
    path = os.path.join(folder, "consolidated.00.pth")
    tensors = torch.load(path, weights_only=True)
    tensors["layers.3.attention.wk.weight"] = tensors["layers.3.attention.wk.weight"][:-8].clone()
    torch.save(tensors, path)
    server = Server(str(tmp_path / "ts"), tp=2)
    status, output, _ = server.make_serve(f"CKPT={folder}", timeout=180)  # TorchServe would retry for 600 s
    try:
        assert status != 0, (status, output[-3000:])
        assert re.search(rf"rank [01]/2: CheckpointError: tensor layers\.3\.attention\.wk\.weight in {re.escape(path)} "
                         r"has shape \(120, 256\)", output), output[-3000:]
        assert "the traceback ends:" in output and "TorchServe has stopped." in output
        assert no_torchserve_left(server)
    finally:
        server.stop()


def stamp(seconds: float) -> str:
    """log4j's timestamp for a time.time(), as TorchServe's logs have it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(seconds)) + ",000"


@pytest.mark.slow  # waits on logs and processes
@pytest.mark.parametrize("ending", ["worker failed", "frontend stopped"])
def test_wait_reads_progress_and_failure_from_the_logs(tmp_path, ending):
    """wait_ready on logs written here (no server: nothing answers the URL), which begin with
    an earlier run's failure: each stage of this run goes to show, and the end of loading in
    this run's lines ends the wait within seconds."""
    started = time.time() - 30
    before = f"{stamp(started - 600)} [INFO ] W-1-stdout MODEL_LOG - "
    now = f"{stamp(started)} [INFO ] W-2-stdout MODEL_LOG - "
    model_log = [before + "loading rank=0/2: failed; error=OSError: an earlier run's"]
    model_log += [now + f"loading rank={r}/2: weights loaded; bytes=9445888 seconds=0.04 dtype=float32" for r in (0, 1)]
    ts_log = [f"{stamp(started - 600)} [WARN ] W-1 BatchAggregator - Load model failed: llama, error: Worker died."]
    if ending == "worker failed":
        model_log += [now + line for line in [
            "loading rank=1/2: failed; error=CheckpointError: tensor x in /c/consolidated.00.pth is bad",
            "Traceback (most recent call last):", '  File "/m/checkpoint.py", line 168, in tensor',
            "    raise CheckpointError(message)",
            "checkpoint.CheckpointError: tensor x in /c/consolidated.00.pth is bad", "Backend worker process died."]]
        ts_log.append(f"{stamp(started + 1)} [WARN ] W-2 BatchAggregator - Load model failed: llama, error: "
                      "Worker died.")
    else:
        ts_log.append(f"{stamp(started + 1)} [INFO ] main org.pytorch.serve.ModelServer - Torchserve stopped.")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "model_log.log").write_text("\n".join(model_log) + "\n")
    (logs / "ts_log.log").write_text("\n".join(ts_log) + "\n")
    shown = []
    start = time.monotonic()
    with pytest.raises(wait_ready.LoadFailed) as e:
        wait_ready.wait(f"http://127.0.0.1:{free_port()}", str(tmp_path / "key_file.json"), 60, str(logs),
                        lambda status, event: shown.append((status, event)), since=int(started))
    assert time.monotonic() - start < 5
    assert shown[:2] == [(f"loading: 0 s, 0/2 ranks ready, {gb} GB read",
                          f"rank {r}/2: weights loaded (9.4 MB, 0.04 s, dtype float32)")
                         for r, gb in ((0, "0.01"), (1, "0.02"))]
    assert "earlier run" not in str(e.value)
    if ending == "worker failed":
        assert "rank 1/2: CheckpointError: tensor x in /c/consolidated.00.pth is bad" in str(e.value)
        assert str(e.value).endswith('raise CheckpointError(message)\n    checkpoint.CheckpointError: tensor x '
                                     'in /c/consolidated.00.pth is bad')
    else:
        assert "TorchServe stopped while the model was loading" in str(e.value)


# one server started by `make serve` for the configuration keys: a checkpoint outside the archive,
# bfloat16 on CPU, request defaults of its own
DEFAULTS = {"max_new_tokens": 6, "temperature": 1.3, "top_p": 0.5, "top_k": 7}
STOCK = {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.9, "top_k": 0}  # model-config.yaml's


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    outside = demo_copy(tmp_path_factory.mktemp("models") / "demo-copy")
    server = Server(str(tmp_path_factory.mktemp("configured")), tp=2)
    settings = ["batchSize=2", "handler.max_seq_len=256", "handler.dtype=bfloat16"]
    settings += [f"handler.defaults.{k}={v}" for k, v in DEFAULTS.items()]
    try:
        status, output, seconds = server.make_serve(f"CKPT={outside}", settings=tuple(settings), timeout=400)
        assert status == 0, output[-3000:]
        yield server, output, outside
    finally:
        server.stop(wait=False)


def test_make_serve_shows_each_rank_loading(configured):
    _, output, _ = configured
    seen = set(re.findall(r"rank (\d)/2: (reading checkpoint|weights loaded|kv cache allocated|not compiled|ready)",
                          output))
    stages = ["reading checkpoint", "weights loaded", "kv cache allocated", "not compiled", "ready"]
    assert seen == {(rank, stage) for rank in "01" for stage in stages}, output[-3000:]
    assert re.search(r"loading: \d+ s, 2/2 ranks ready, 0\.0\d GB read", output), output[-3000:]


def test_checkpoint_is_served_in_place(configured):
    server, output, outside = configured
    with zipfile.ZipFile(os.path.join(server.workdir, "model_store", "llama.mar")) as mar:
        names = mar.namelist()
    assert "handler.py" in names and not [n for n in names if n.endswith((".pth", ".model", "params.json"))]
    assert len(re.findall(rf"rank [01]/2: reading checkpoint \(path {re.escape(outside)}\)", output)) == 2
    answer = server.generate({"prompt": "Once upon a time", "max_new_tokens": 3, "temperature": 0})
    assert (answer["finish_reason"], answer["usage"]["completion_tokens"]) == ("length", 3)


def test_dtype_bfloat16_on_cpu(configured, demo_llama):
    """Loaded in bfloat16 (each rank says so), and scores as a rounded copy of the model does:
    near it in float32 and in bfloat16 in this process, but measurably off the float32 values
    (at TP=2, bfloat16's partial sums round differently from TP=1's)."""
    from llama2 import tp_llama

    server, output, _ = configured
    assert len(re.findall(r"rank [01]/2: weights loaded \([^)]*dtype bfloat16\)", output)) == 2
    prompt = "The secret of a happy life is to be found in small things"
    served = server.generate({"prompt": prompt, "max_new_tokens": 1, "temperature": 0, "logprobs": True,
                              "echo": True})["logprobs"][1:-1]
    bf16 = tp_llama(None, DEMO, os.path.join(DEMO, "tokenizer.model"), 1, dtype=torch.bfloat16, max_batch_size=1,
                    max_seq_len=64)
    in_bf16 = bf16.text_completion([prompt], 1, temperature=0, logprobs=True, echo=True)[0]["logprobs"][1:-1]
    in_fp32 = demo_llama.text_completion([prompt], 1, temperature=0, logprobs=True, echo=True)[0]["logprobs"][1:-1]
    # float32 serving gives the in-process float32 values to ~1e-5 (test_server.py allows 1e-3)
    assert max(abs(a - b) for a, b in zip(served, in_fp32)) > 2e-3
    assert max(abs(a - b) for a, b in zip(served, in_fp32)) < 0.1  # the same model, rounded
    assert max(abs(a - b) for a, b in zip(served, in_bf16)) < 0.1


def test_request_defaults_come_from_the_config(configured):
    """A request that names no option gets handler.defaults, each of them: naming one at
    model-config.yaml's stock value instead changes the answer."""
    server, _, _ = configured
    body = {"prompt": "Once upon a time", "seed": 11, "ignore_eos": True}  # it runs to max_new_tokens
    answer = server.generate(body)
    assert (answer["finish_reason"], answer["usage"]["completion_tokens"]) == ("length", DEFAULTS["max_new_tokens"])
    assert server.generate(body | DEFAULTS) == answer
    for key, stock in STOCK.items():
        assert server.generate(body | DEFAULTS | {key: stock}) != answer, key


# --- 3. the handler's defaults for keys a config leaves out, as README.md states them -------------

def readme_config_table() -> dict[str, str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return dict(re.findall(r"^\| `handler\.(\w+)` \| ([^|]*?) \|", f.read(), re.M))


def test_readme_and_model_config_state_the_handlers_defaults():
    table = readme_config_table()
    shipped = base_config()["handler"]
    defaults = {f.name: f.default for f in dataclasses.fields(ServingConfig)
                if f.default not in (None, dataclasses.MISSING)}  # not the tokenizer, limits and defaults
    assert set(defaults) == set(shipped) - {"tokenizer", "limits", "defaults"}
    for key, value in defaults.items():
        assert table[key].strip("`") == (str(value).lower() if isinstance(value, bool) else str(value)), key
        assert shipped[key] == value, key


@pytest.mark.slow  # waits on logs and processes
@pytest.mark.parametrize("cores, overlap, steps", [(2, False, (4, 16, 0.2)), (3, True, (1, 1, 0.0))])
def test_a_config_without_handler_keys_gets_the_defaults(tmp_path, monkeypatch, cores, overlap, steps):
    """The handler loads <archive>/weights with a 512-token context when model-config.yaml
    says nothing (TorchServe's context, faked: one rank, in this process). With torch on 2
    threads, overlap is on only with a core to spare (3 cores, not 2): then one step an
    iteration, else 4 to 16 (those that fit in 200 ms)."""
    import handler

    monkeypatch.setenv("TS_DECODE_INPUT_REQUEST", "true")  # restored: initialize sets it
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    os.symlink(os.path.abspath(DEMO), tmp_path / "weights")

    class Context:
        model_name = "llama"
        model_yaml_config = {"continuousBatching": True}
        system_properties = {"model_dir": str(tmp_path), "batch_size": 2}

    h = handler.LlamaHandler()
    h.initialize(Context())
    assert h.max_seq_len == 512 and h.engine.runner.max_seq_len == 512
    assert h.engine.runner.dtype == torch.float32  # dtype auto on CPU
    assert h.engine.runner.compiled_decode is None
    assert h.engine.scheduler.max_batched_tokens == 64  # max_batched_tokens auto on CPU
    assert h.overlap is overlap and h.steps_per_iteration == steps


@pytest.mark.parametrize("setting, value, message", [
    ("steps_per_iteration", 0, "handler.steps_per_iteration must be auto or a whole number >= 1, got 0"),
    ("steps_per_iteration", "4", "handler.steps_per_iteration must be auto or a whole number >= 1, got '4'"),
    ("overlap", "yes", "handler.overlap must be auto, true or false, got 'yes'"),
    ("max_batched_tokens", -1, "handler.max_batched_tokens must be auto or a whole number >= 0, got -1"),
    ("compile", "yes", "handler.compile must be true or false, got 'yes'"),
])
def test_the_handler_refuses_a_bad_setting_by_name(setting, value, message):
    """A wrong value in model-config.yaml's handler section stops the worker at load with the
    setting's name, before any weights are read."""
    import types

    import handler

    ctx = types.SimpleNamespace(model_yaml_config={"continuousBatching": True, "handler": {setting: value}},
                                system_properties={"model_dir": DEMO})
    with pytest.raises(ValueError, match=re.escape(message)):
        handler.LlamaHandler().initialize(ctx)


def test_ports_do_not_follow_the_global_random_state():
    """The servers' ports come from local_server's own generator: after a library seeds the
    global one (lm_eval's simple_evaluate does), every run drew the same ports, and socket
    files left in /tmp by earlier runs came to block all of them."""
    state, draws = random.getstate(), []
    for _ in range(2):
        random.seed(0)
        draws.append([free_port() for _ in range(8)])
    random.setstate(state)
    assert draws[0] != draws[1]
