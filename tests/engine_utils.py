"""Shared helpers of the engine-level tests (tests/test_engine*.py).

- `model_path(name)`: small HF checkpoints made once per test process, in one temp dir.
- `run_to_completion(core, requests, joins=..., aborts=...)`: drives `EngineCore.step()` and
  records every step's schedule and scheduler stats.
- `step_outputs(core)`: one step's outputs, for a core driven in-process (no client identity).
- `hf_generate(...)`: the transformers reference (float32 CPU `generate` on the same
  checkpoint) with its raw logits, so tests can check logprobs and, when a greedy comparison
  fails, whether the reference itself stood on a near-tie.
"""
from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from tidal.core.engine_core import EngineCore
from tidal.protocol import EngineConfig, SamplingParams
from tidal.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
    SchedulerOutput,
    SchedulerStats,
)

EOS = 2  # make_model's <|im_end|>
VOCAB = 512

# name -> (arch, make_model kwargs). seeds differ per model.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama: MHA, untied (Llama's default) / GQA 6:2, tied, 3 layers
    "llama-mha-untied": ("llama", dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, seed=11)),
    "llama-gqa-tied": ("llama", dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=2,
                                     tie_word_embeddings=True, seed=12)),
    # Qwen2 (qkv bias): GQA 4:2 tied (default) / MQA 4:1, untied, wider MLP
    "qwen2-gqa-tied": ("qwen2", dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=21)),
    "qwen2-mqa-untied": ("qwen2", dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1,
                                       tie_word_embeddings=False, intermediate_size=320, seed=22)),
    # Qwen3 (q/k norm): GQA 4:2 tied (default) / GQA 8:2, head_dim*heads != hidden, untied
    "qwen3-gqa-tied": ("qwen3", dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=31)),
    "qwen3-untied": ("qwen3", dict(hidden_size=96, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16,
                                   tie_word_embeddings=False, seed=32)),
    # The workhorse of the feature tests: small and fast.
    "tiny": ("qwen3", dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=7)),
    # Vocab 4096 > the sampler's 1024-token race blocks: seeded sampling runs its 2-level race.
    # (The core sees ids only: tiny's 512-token tokenizer spares training a 4096 one.)
    "tiny-4k": ("qwen3", dict(vocab_size=4096, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=8,
                              tokenizer_from="tiny")),
    # Even smaller, for the randomized invariant sweep.
    "micro": ("llama", dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=5)),
}

_model_dir: str | None = None
_paths: dict[str, str] = {}
_hf: dict[str, Any] = {}


def model_path(name: str) -> str:
    """Path of the checkpoint `name` (made on first use, in a temp dir removed at exit)."""
    global _model_dir
    if name not in _paths:
        from tidal.frontend.entrypoints.make_model import make_model

        if _model_dir is None:
            _model_dir = tempfile.mkdtemp(prefix="tidal-engine-tests-")
            atexit.register(shutil.rmtree, _model_dir, True)
        arch, kwargs = MODELS[name]
        kwargs = dict(kwargs)
        if "tokenizer_from" in kwargs:
            kwargs["tokenizer_dir"] = model_path(kwargs.pop("tokenizer_from"))
        # Tokenizers are cached in our temp dir, never the user's ~/.cache/tidal (as conftest).
        old = os.environ.get("TIDAL_CACHE_DIR")
        os.environ["TIDAL_CACHE_DIR"] = f"{_model_dir}/cache"
        try:
            _paths[name] = make_model(f"{_model_dir}/{name}", arch, **{"vocab_size": VOCAB, **kwargs})
        finally:
            if old is None:
                del os.environ["TIDAL_CACHE_DIR"]
            else:
                os.environ["TIDAL_CACHE_DIR"] = old
    return _paths[name]


def make_core(name_or_path: str, **kwargs: Any) -> EngineCore:
    path = model_path(name_or_path) if name_or_path in MODELS else name_or_path
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    return EngineCore(EngineConfig(model=path, **kwargs))


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def req(request_id: str, prompt: list[int], params: SamplingParams, eos: int | None = EOS) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(prompt), params, eos_token_id=eos)


def random_prompt(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    """n token ids avoiding the 3 special ids (so eos never sits in a prompt)."""
    return [rng.randrange(3, vocab) for _ in range(n)]


# --------------------------------------------------------------------------- running


@dataclass
class ReqResult:
    tokens: list[int] = field(default_factory=list)
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def logprobs(self) -> LogprobsArrays | None:
        parts = [o.new_logprobs for o in self.outputs if o.new_logprobs is not None]
        return LogprobsArrays.concat(parts) if parts else None

    @property
    def prompt_logprobs(self) -> LogprobsArrays | None:
        parts = [o.new_prompt_logprobs for o in self.outputs if o.new_prompt_logprobs is not None]
        return LogprobsArrays.concat(parts) if parts else None


@dataclass
class StepRecord:
    num_scheduled_tokens: dict[str, int]
    total: int
    new_reqs: list[str]
    finished_req_ids: list[str]
    stats: SchedulerStats  # after the step
    num_running: int  # len(scheduler.running) right after schedule()


@dataclass
class RunResult:
    results: dict[str, ReqResult]
    steps: list[StepRecord]
    stats: SchedulerStats  # at the end
    errors: list[EngineCoreOutput] = field(default_factory=list)  # rejections of add_request

    def __getitem__(self, request_id: str) -> ReqResult:
        return self.results[request_id]

    def tokens(self) -> dict[str, list[int]]:
        return {rid: r.tokens for rid, r in self.results.items()}

    def mixed_steps(self) -> list[StepRecord]:
        """Steps that ran a prefill chunk (> 1 token) beside a decode (1 token)."""
        return [s for s in self.steps
                if any(n > 1 for n in s.num_scheduled_tokens.values())
                and any(n == 1 for n in s.num_scheduled_tokens.values())]


def record_schedules(core: EngineCore) -> list[tuple[SchedulerOutput, int]]:
    """Wrap `core.scheduler.schedule` (instance attribute); returns the list it appends to:
    (SchedulerOutput, len(running) just after scheduling)."""
    log: list[tuple[SchedulerOutput, int]] = []
    sched = core.scheduler
    original = type(sched).schedule.__get__(sched)

    def schedule() -> SchedulerOutput:
        so = original()
        log.append((so, len(sched.running)))
        return so

    sched.schedule = schedule  # type: ignore[method-assign]
    return log


def step_outputs(core: EngineCore) -> list[EngineCoreOutput]:
    """Run one step; its outputs (requests added here have client_index None: all are ours)."""
    by_client = core.step()
    assert set(by_client) <= {None}, by_client
    return by_client.get(None, EngineCoreOutputs()).outputs


def run_to_completion(
    core: EngineCore,
    requests: Iterable[EngineCoreRequest],
    joins: dict[int, list[EngineCoreRequest]] | None = None,
    aborts: dict[int, list[str]] | None = None,
    max_steps: int = 5000,
) -> RunResult:
    """Add `requests`, then step until nothing is unfinished (and no join is pending).

    aborts[s] / joins[s] are aborted / added (in that order) right before step s (0-based)
    runs; their ABORT and ERROR (rejection) outputs come out of that step like the others.
    Rejections are also kept in `errors`; one for an id in use leaves that request's record alone.
    An id aborted and re-added before the same step gets a fresh record (the ABORT output, which
    comes first, ends the old one).
    Every step's schedule and the stats after it are kept in `steps`.
    """
    joins = dict(joins or {})
    aborts = dict(aborts or {})
    results: dict[str, ReqResult] = {}
    steps: list[StepRecord] = []
    errors: list[EngineCoreOutput] = []
    log = record_schedules(core)
    shadowed: list[str] = []  # ids added while in use: their rejection is not their record's
    replaced: dict[str, ReqResult] = {}  # ids re-added before their last output came: old record

    def take(out: EngineCoreOutput) -> None:
        rid = out.request_id
        if out.error is not None:
            errors.append(out)
            if rid in shadowed:
                shadowed.remove(rid)
                return
        r = replaced.pop(rid) if rid in replaced else results.setdefault(rid, ReqResult())
        assert r.finish_reason is None, f"output after the finish of {out.request_id}: {out}"
        r.outputs.append(out)
        r.tokens.extend(out.new_token_ids)
        r.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            r.finish_reason = out.finish_reason
            r.stop_reason = out.stop_reason
            r.error = out.error

    def add(rs: Iterable[EngineCoreRequest]) -> None:
        for r in rs:
            rid, prev = r.request_id, results.get(r.request_id)
            live = prev is not None and prev.finish_reason is None
            if live and rid in core.scheduler.requests:
                shadowed.append(rid)  # in use: rejected, the running request keeps its record
            else:
                if live:
                    replaced[rid] = prev  # aborted just now: its ABORT output is still to come
                results[rid] = ReqResult()  # a reused id starts afresh
            core.add_request(r)

    add(requests)
    step = 0
    while step == 0 or core.has_unfinished_requests() or joins or aborts:  # step 0: rejections
        assert step < max_steps, "engine did not finish"
        if step in aborts:
            core.abort_requests(aborts.pop(step))
        if step in joins:
            add(joins.pop(step))
        n_before = len(log)
        for out in step_outputs(core):
            take(out)
        if len(log) > n_before:
            so, n_running = log[-1]
            steps.append(StepRecord(dict(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
                                    [n.req_id for n in so.scheduled_new_reqs], list(so.finished_req_ids),
                                    core.scheduler.make_stats(), n_running))
        step += 1
    return RunResult(results, steps, core.scheduler.make_stats(), errors)


def run_with_culprits(core: EngineCore, good: list[EngineCoreRequest], bad: list[EngineCoreRequest],
                      *messages: str) -> RunResult:
    """Run `good` with the (one or two) `bad` requests among them in one batch (not first, not
    last), asserting that each bad one failed alone with an error holding every `messages`."""
    requests = list(good)
    requests[1:1] = bad[:1]
    requests[4:4] = bad[1:]
    run = run_to_completion(core, requests)
    for r in bad:
        got = run[r.request_id]
        assert got.finish_reason == FinishReason.ERROR and got.tokens == [], got
        assert all(m in (got.error or "") for m in messages), got.error
    return run


def assert_all_blocks_free(core: EngineCore) -> None:
    stats = core.scheduler.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
    assert not core.scheduler.kv_cache_manager.req_to_blocks
    assert all(b.ref_cnt == 0 for b in core.scheduler.kv_cache_manager.block_pool.blocks)


# --------------------------------------------------------------------------- reference


def hf_model(name_or_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    path = model_path(name_or_path) if name_or_path in MODELS else name_or_path
    if path not in _hf:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        m.generation_config.eos_token_id = None  # ignore_eos unless a test passes one
        m.generation_config.pad_token_id = 0
        _hf[path] = m
    return _hf[path]


@dataclass
class Ref:
    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), V] the scores each token was chosen from (after masks)

    @property
    def gaps(self) -> list[float]:
        top2 = self.logits.topk(2, -1).values
        return (top2[:, 0] - top2[:, 1]).tolist()


_ref_cache: dict[tuple, Ref] = {}


def hf_generate(name: str, prompt: list[int], max_tokens: int, *, eos: int | None = None,
                min_tokens: int = 0) -> Ref:
    """transformers greedy `generate` (float32, CPU); stops at `eos` (if given) once
    `min_tokens` tokens are out, which it forbids before (as HF's min_new_tokens)."""
    key = (name, tuple(prompt), max_tokens, eos, min_tokens)
    if key not in _ref_cache:
        model = hf_model(name)
        ids = torch.tensor([prompt])
        kwargs: dict[str, Any] = {}
        if eos is not None:
            kwargs["eos_token_id"] = eos
            if min_tokens:
                kwargs["min_new_tokens"] = min_tokens
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_tokens, output_scores=True,
                               return_dict_in_generate=True, **kwargs)
        _ref_cache[key] = Ref(g.sequences[0, len(prompt):].tolist(), torch.stack(g.scores)[:, 0].float())
    return _ref_cache[key]


def hf_log_softmax(name: str, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: row p is log_softmax of the logits after token_ids[: p + 1]."""
    with torch.no_grad():
        logits = hf_model(name)(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def robust_prompt(name: str, rng: random.Random, n: int, max_tokens: int, prefix: list[int] = (),
                  min_gap: float = 1e-3) -> list[int]:
    """prefix + n random ids such that transformers' greedy continuation (max_tokens) never
    has a top-2 logit gap below min_gap: greedy comparisons then cannot hinge on float noise
    (engine vs transformers logits differ by ~1e-6 here). Deterministic given rng."""
    for _ in range(50):
        prompt = list(prefix) + random_prompt(rng, n)
        if min(hf_generate(name, prompt, max_tokens).gaps) >= min_gap:
            return prompt
    raise AssertionError(f"no prompt without a near-tie for {name}")


def assert_greedy_equal(got: list[int], ref: Ref, what: str = "") -> None:
    """Token-identical, or a failure that says how close the reference was to a tie there."""
    if got == ref.tokens:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), min(len(got), len(ref.tokens)))
    gap = ref.gaps[i] if i < len(ref.gaps) else float("nan")
    raise AssertionError(
        f"{what}: greedy tokens differ from transformers at output {i} "
        f"(reference top-2 logit gap there: {gap:.3g}; a gap < 1e-4 would be a numerical near-tie)\n"
        f"  engine: {got}\n  hf:     {ref.tokens}")


def check_logprobs(arrays: LogprobsArrays, ref_lp: torch.Tensor, chosen: list[int], k: int,
                   atol: float = 1e-3, what: str = "") -> None:
    """Engine LogprobsArrays (rows = positions) against reference log-softmax rows [N, V]:
    column 0 = chosen token and its logprob, columns 1..k = top-k ids and values (a swapped
    id is accepted only where the reference values tie within atol), ranks of the chosen."""
    n = len(chosen)
    assert arrays.token_ids.shape == (n, k + 1), (what, arrays.token_ids.shape, n, k)
    assert arrays.logprobs.shape == (n, k + 1) and arrays.ranks.shape == (n,), what
    ids = torch.from_numpy(np.asarray(arrays.token_ids, dtype=np.int64))
    lps = torch.from_numpy(np.asarray(arrays.logprobs, dtype=np.float32))
    assert ids[:, 0].tolist() == chosen, (what, "column 0 is not the chosen token")
    ref_chosen = ref_lp.gather(1, torch.tensor(chosen)[:, None]).squeeze(1)
    torch.testing.assert_close(lps[:, 0], ref_chosen, atol=atol, rtol=0, msg=lambda m: f"{what} chosen: {m}")
    if k:
        top_v, top_i = ref_lp.topk(k, -1)
        torch.testing.assert_close(lps[:, 1:], top_v, atol=atol, rtol=0, msg=lambda m: f"{what} top-k: {m}")
        # Ids: equal, or the reference values of the two ids tie.
        swapped = ids[:, 1:] != top_i
        if swapped.any():
            diff = (ref_lp.gather(1, ids[:, 1:]) - top_v).abs()
            assert bool((diff[swapped] < atol).all()), (what, "top-k ids differ", ids[:, 1:], top_i)
    lo = (ref_lp > ref_chosen[:, None] + atol).sum(-1) + 1
    hi = (ref_lp > ref_chosen[:, None] - atol).sum(-1) + 1
    ranks = torch.from_numpy(np.asarray(arrays.ranks, dtype=np.int64))
    assert bool(((ranks >= lo) & (ranks <= hi)).all()), (what, "ranks", ranks.tolist(), lo.tolist(), hi.tolist())
