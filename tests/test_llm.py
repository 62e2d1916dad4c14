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
        assert isinstance(engine.llm_engine, InprocClient)
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
    engine = LLM(model=long_model_dir, model_runner="null", max_model_len=65536, max_num_seqs=2)
    assert isinstance(engine.llm_engine, SyncMPClient)
    proc = engine.llm_engine.process
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
