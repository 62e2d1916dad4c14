"""LLM (sync, offline): order, params, validation before anything runs, in-process mode, death."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Iterator

import pytest

from tidal.frontend import LLM
from tidal.frontend.core_client import InprocClient, SyncMPClient
from tidal.protocol import EngineDeadError, SamplingParams

try:
    from conftest import core_children
except ImportError:  # tests/ made a package
    from tests.conftest import core_children  # type: ignore[no-redef]


@pytest.fixture(scope="module")
def llm(long_model_dir: str) -> Iterator[LLM]:
    with LLM(model=long_model_dir, model_runner="null", max_model_len=2048) as engine:
        yield engine


def test_outputs_in_input_order(llm: LLM) -> None:
    prompts = [f"prompt number {i}" for i in range(12)]
    params = [SamplingParams(max_tokens=40 - 3 * i, ignore_eos=True) for i in range(12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [40 - 3 * i for i in range(12)]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.metrics is None for o in outs)  # stats are off by default


def test_single_and_shared_params_and_prompt_forms(llm: LLM, capsys: Any) -> None:
    one = llm.generate("just one", SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(one) == 1 and len(one[0].outputs[0].token_ids) == 5
    outs = llm.generate(["a", {"prompt_token_ids": [5, 6, 7]}, {"prompt": "c"}],
                        SamplingParams(max_tokens=7, ignore_eos=True, n=2))
    assert [o.prompt_token_ids for o in outs][1] == [5, 6, 7]
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 7 for c in o.outputs) for o in outs)
    default = llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm=True)
    assert len(default[0].outputs[0].token_ids) == SamplingParams().max_tokens
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "output:" in err and "toks/s" in err


@pytest.mark.parametrize("prompts, params", [
    (["ok", ""], None),  # an empty prompt after a good one
    (["ok", {"prompt_token_ids": [1, 10**6]}], None),  # token id out of vocabulary
    (["ok", 42], None),  # not a prompt
    (["ok", {"prompt_ids": [1]}], None),  # unknown key
    (["ok", "x" * 5000], None),  # longer than max_model_len
    (["ok", "ok"], [SamplingParams()]),  # params list of the wrong length
    (["ok", "ok"], [SamplingParams(), "temperature=0"]),  # not SamplingParams
    (["ok"], SamplingParams(logprobs=1000)),  # more than max_logprobs
])
def test_bad_input_raises_before_anything_runs(llm: LLM, prompts: Any, params: Any) -> None:
    before = llm.get_stats().num_prompt_tokens
    with pytest.raises(ValueError):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.output_processor.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_prompt_tokens == before and stats.num_waiting_reqs == stats.num_running_reqs == 0


def test_max_tokens_past_the_window_stops_at_max_model_len(llm: LLM) -> None:
    """As vLLM's engine: no error, the request ends at max_model_len with "length"."""
    prompt = {"prompt_token_ids": [t % 500 + 1 for t in range(2000)]}
    out = llm.generate(prompt, SamplingParams(max_tokens=4000, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2048 - 2000
    assert out.outputs[0].finish_reason == "length"


def test_stop_string_and_stats(llm: LLM) -> None:
    base = llm.generate("stop me", SamplingParams(max_tokens=60, ignore_eos=True, seed=3), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[20:22]
    if not stop or "\ufffd" in stop:
        pytest.skip("no usable stop string in this text")
    out = llm.generate("stop me", SamplingParams(max_tokens=60, ignore_eos=True, seed=3, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == text[:text.index(stop)] and out.outputs[0].finish_reason == "stop"
    stats = llm.llm_engine.get_stats()
    assert stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_request_metrics_with_stats_on(long_model_dir: str) -> None:
    """disable_log_stats=False: each output carries its request's timings (vLLM's names)."""
    with LLM(model=long_model_dir, model_runner="null", max_model_len=2048, disable_log_stats=False) as engine:
        t0 = time.time()
        outs = engine.generate(["a b c", "d"], SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)
        t1 = time.time()
    for out in outs:
        m = out.metrics
        assert m is not None and t0 <= m.arrival_time <= t1
        assert 0 < m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts <= time.monotonic()
        assert m.num_generation_tokens == len(out.outputs[0].token_ids) == 7
        assert 0 < m.first_token_latency <= t1 - m.arrival_time


def test_in_process_mode(long_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_ENABLE_MULTIPROCESSING", "0")
    before = {p.pid for p in core_children()}
    with LLM(model=long_model_dir, model_runner="null", max_model_len=2048) as engine:
        assert isinstance(engine.engine_core, InprocClient)
        assert {p.pid for p in core_children()} == before  # no engine-core process
        outs = engine.generate(["x", "y"], [SamplingParams(max_tokens=3, ignore_eos=True),
                                            SamplingParams(max_tokens=9, ignore_eos=True, n=2)], use_tqdm=False)
        assert [len(c.token_ids) for o in outs for c in o.outputs] == [3, 9, 9]
        assert engine.get_tokenizer() is engine.tokenizer
        with pytest.raises(ValueError):
            engine.generate(["x", ""], use_tqdm=False)
        assert engine.get_stats().num_waiting_reqs == 0


def test_unknown_engine_arg_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(model="whatever", no_such_arg=3)


def test_dead_core_raises_and_shutdown_cleans_up(long_model_dir: str, no_leaked_cores: None) -> None:
    engine = LLM(model=long_model_dir, model_runner="null", max_model_len=65536, max_num_seqs=2,
                 max_core_restarts=0)  # no restart: the dead core is final
    assert isinstance(engine.engine_core, SyncMPClient)
    proc = engine.engine_core.process
    assert proc is not None
    killer = threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL))  # mid-generate
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        engine.generate("x", SamplingParams(max_tokens=60000, ignore_eos=True), use_tqdm=False)
    killer.join()
    assert time.monotonic() - t0 < 5.5
    with pytest.raises(EngineDeadError):
        engine.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    engine.shutdown()
    assert proc.pid not in {p.pid for p in core_children()}
    del engine  # __del__ after shutdown is harmless


def test_unknown_model_dir_or_architecture_is_a_value_error(tmp_path: Any, long_model_dir: str,
                                                            no_leaked_cores: None) -> None:
    import json
    import shutil

    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))
    bad = tmp_path / "gpt2ish"
    shutil.copytree(long_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    # Rejected in the front-end, naming what is supported, before any core process starts.
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM, "
                                         "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(model=str(bad))


def test_max_model_len_above_the_models_is_a_value_error(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                         no_leaked_cores: None) -> None:
    """vLLM refuses it at config time; so does tidal: a ValueError naming both numbers, raised
    before a core process is started (starting one fails the test)."""
    import json

    from tidal.frontend import core_process

    model_max = json.load(open(f"{tiny_model_dir}/config.json"))["max_position_embeddings"]

    def no_core(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a core process was started")

    monkeypatch.setattr(core_process.CoreProcess, "__init__", no_core)
    with pytest.raises(ValueError, match=f"max_model_len {model_max + 1} is larger than the model's "
                                         f"max_position_embeddings {model_max}"):
        LLM(model=tiny_model_dir, max_model_len=model_max + 1)
    monkeypatch.undo()
    llm = LLM(model=tiny_model_dir, model_runner="null", max_model_len=model_max)  # the limit itself is fine
    try:
        assert llm.llm_engine.info.max_model_len == model_max
    finally:
        llm.shutdown()


# ------------------------------------------------------- vLLM engine args and views


def test_engine_arg_classes_at_construction(long_model_dir: str, caplog: pytest.LogCaptureFixture,
                                            no_leaked_cores: None) -> None:
    """Refused and misspelt args fail before any process starts; no-ops warn once and run."""
    with pytest.raises(ValueError, match="LoRA"):
        LLM(model=long_model_dir, model_runner="null", enable_lora=True)
    with pytest.raises(TypeError, match="did you mean 'enforce_eager'"):
        LLM(model=long_model_dir, model_runner="null", enforce_eagr=True)
    with caplog.at_level("WARNING", logger="tidal.engine_args"):
        with LLM(long_model_dir, model_runner="null", max_model_len=256, compilation_config=3,
                 swap_space=8, enforce_eager=True, multiprocessing=False) as engine:
            out = engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, ignore_eos=True),
                                  use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and engine.config.enforce_eager
    warned = sorted(r.getMessage().split("=")[0] for r in caplog.records)
    assert warned == ["engine arg compilation_config", "engine arg swap_space"]


def test_config_views_match_config_json(tiny_model_dir: str) -> None:
    import json

    import torch

    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        raw = json.load(f)
    with LLM(tiny_model_dir, model_runner="null", multiprocessing=False, served_model_name="tiny") as engine:
        vc = engine.llm_engine.vllm_config
        mc = engine.llm_engine.model_config
        assert mc is not None and engine.model_config.max_model_len == raw["max_position_embeddings"]
        assert vc.model_config.get_vocab_size() == raw["vocab_size"] == mc.hf_config.vocab_size
        assert mc.get_hidden_size() == raw["hidden_size"] and mc.get_num_layers() == raw["num_hidden_layers"]
        assert mc.dtype == getattr(torch, raw.get("dtype") or raw["torch_dtype"])
        assert mc.architectures == raw["architectures"] and mc.tokenizer == tiny_model_dir
        assert (mc.model, mc.served_model_name, mc.logprobs_mode, mc.max_logprobs, mc.seed) == (
            tiny_model_dir, "tiny", "raw_logprobs", 20, 0)
        assert vc.cache_config.num_gpu_blocks == engine.info.num_kv_blocks
        assert vc.scheduler_config.max_model_len == raw["max_position_embeddings"]
        assert vc.parallel_config.world_size == 1 and vc.lora_config is None
        assert engine.llm_engine.get_tokenizer() is engine.get_tokenizer() is engine.llm_engine.tokenizer
        assert engine.llm_engine.log_stats is False  # LLM's default, as vLLM
        assert engine.llm_engine.get_stats().num_running_reqs == 0  # the core client's, as before


def test_skip_tokenizer_init(tiny_model_dir: str) -> None:
    with LLM(tiny_model_dir, model_runner="null", multiprocessing=False, skip_tokenizer_init=True) as engine:
        assert engine.llm_engine.tokenizer is None
        with pytest.raises(ValueError):
            engine.get_tokenizer()
        with pytest.raises(ValueError, match="tokenizer"):
            engine.generate("text needs a tokenizer", use_tqdm=False)
        out = engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True),
                              use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == "" and out.prompt_token_ids == [5, 6, 7]


def test_tokenizer_mode_and_revisions_reach_from_pretrained(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from tidal.frontend.engine_args import EngineArgs
    from tidal.frontend.engine_setup import load_tokenizer

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: seen.append(kw) or object())
    for kwargs in (dict(tokenizer_mode="slow", revision="r1"), dict(tokenizer_mode="hf", tokenizer_revision="t2"),
                   dict()):
        # The front-end's own tokenizer (frontend/tokenizer.py) loads transformers' one on first
        # need (here: at once), with the same arguments.
        tok = load_tokenizer(EngineArgs(model=tiny_model_dir, **kwargs).create_engine_config())
        if type(tok).__name__ == "LeanTokenizer":
            tok._full_tokenizer()
    assert [(kw["use_fast"], kw["revision"]) for kw in seen] == [(False, "r1"), (True, "t2"), (True, None)]


def test_priority_reaches_the_core_request(long_model_dir: str) -> None:
    with LLM(long_model_dir, model_runner="null", multiprocessing=False, scheduling_policy="priority",
             max_model_len=256) as engine:
        sent: list[Any] = []
        add = engine.engine_core.add_request
        engine.engine_core.add_request = lambda req: (sent.append(req), add(req))[1]  # type: ignore[method-assign]
        outs = engine.generate(["a", "b", "c"], SamplingParams(max_tokens=2, ignore_eos=True),
                               priority=[3, -1, 0], use_tqdm=False)
        assert [o.prompt for o in outs] == ["a", "b", "c"]
        assert [r.priority for r in sent] == [3, -1, 0]
        with pytest.raises(ValueError, match="LoRA"):
            engine.generate("a", lora_request=object(), use_tqdm=False)
        with pytest.raises(ValueError, match="one per prompt"):
            engine.generate(["a", "b"], priority=[1], use_tqdm=False)
    with LLM(long_model_dir, model_runner="null", multiprocessing=False, max_model_len=256) as fcfs:
        with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
            fcfs.generate(["a", "b"], priority=[0, 1], use_tqdm=False)
        assert not fcfs.output_processor.has_unfinished_requests()
        assert fcfs.get_stats().num_waiting_reqs == 0


def test_get_metrics_counts_exactly_what_was_served(long_model_dir: str) -> None:
    """vLLM's LLM.get_metrics(): counters equal the tokens served, one request_success per
    request under its finish reason, one TTFT / e2e sample per request."""
    from tidal.frontend.metrics_reader import Counter, Histogram

    prompts = [{"prompt_token_ids": list(range(1, 1 + n))} for n in (5, 9, 17)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 7, 11)]
    with LLM(model=long_model_dir, model_runner="null", max_model_len=2048, disable_log_stats=False) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        metrics = llm.get_metrics()
    by_name: dict[str, list[Any]] = {}
    for m in metrics:
        by_name.setdefault(m.name, []).append(m)
    counter = lambda name: sum(m.value for m in by_name[name] if isinstance(m, Counter))  # noqa: E731
    assert counter("vllm:generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outs) == 21
    assert counter("vllm:prompt_tokens") == 5 + 9 + 17
    success = {m.labels["finished_reason"]: m.value for m in by_name["vllm:request_success"]}
    assert success["length"] == 3 and sum(success.values()) == 3
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        (hist,) = [m for m in by_name[name] if isinstance(m, Histogram)]
        assert hist.count == 3
    (itl,) = [m for m in by_name["vllm:inter_token_latency_seconds"] if isinstance(m, Histogram)]
    assert itl.count == (3 - 1) + (7 - 1) + (11 - 1)  # one interval per token after the first


def test_get_metrics_needs_stats(llm: LLM) -> None:
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()


def test_generation_config_defaults(long_model_dir: str, tmp_path: Any) -> None:
    """vLLM's generation_config="auto": with no sampling params, generate() uses the defaults in the
    model's generation_config.json (max_new_tokens as max_tokens); "vllm" ignores them."""
    import json
    import shutil

    model = str(tmp_path / "with-gen-config")
    shutil.copytree(long_model_dir, model)
    with open(f"{model}/generation_config.json", "w") as f:
        json.dump({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7}, f)
    with LLM(model=model, model_runner="null", max_model_len=2048) as llm:
        default = llm.get_default_sampling_params()
        assert (default.temperature, default.top_p, default.top_k, default.max_tokens) == (0.6, 0.95, 20, 7)
        (out,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 7
    with LLM(model=model, model_runner="null", max_model_len=2048, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        (out,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == SamplingParams().max_tokens


def test_script_ending_without_shutdown_exits_quietly(tiny_model_dir: str) -> None:
    """vLLM's examples never call shutdown(): the core is stopped at interpreter exit, which is
    no death (nothing logged, no restart). The atexit sleep, registered first so it runs last,
    stands in for a slow exit and makes the watcher's race certain to be run."""
    import subprocess
    import sys

    script = ("import atexit, time\natexit.register(time.sleep, 0.5)\n"
              "from tidal import LLM, SamplingParams\n"
              f"llm = LLM(model={tiny_model_dir!r}, max_model_len=128, num_kv_blocks=16)\n"
              "print(len(llm.generate('hi', SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)"
              "[0].outputs[0].token_ids))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr
    assert "dead" not in done.stderr and "restart" not in done.stderr, done.stderr
