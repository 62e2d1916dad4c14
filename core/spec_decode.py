"""Speculative decoding in the engine core (torch-free): which requests get proposals in a step,
and the n-gram proposer (vLLM's prompt lookup).

How a step speculates (the whole design; DESIGN.md's Determinism rule makes it exact):

- The scheduler asks `SpecDecoder.propose` for a decoding request (one token to compute, the
  one sampled last) and schedules it with 1 + k query rows: its last token, then the k
  proposals (`SchedulerOutput.scheduled_spec_decode_tokens`). They are ordinary query rows of
  the request in the step's mixed batch, as a prefill chunk's are; their KV is written to the
  request's own slots (never a shared prefix-cache block: those lie below num_computed_tokens).
- The worker samples every one of the 1 + k rows with that position's (seed, position) noise
  and the request's history as if the proposals before the row had been accepted, then keeps
  the tokens up to and including the first that differs from its proposal (or all k + 1: the
  bonus token). Row j's sample only counts when proposals 0..j-1 were accepted, and then its
  inputs are exactly those of decoding one by one: the emitted tokens are the ones decoding
  without speculation yields (worker/spec_decode.py).
- The scheduler appends them one by one through the stop checks (EOS, stop ids, max_tokens,
  max_model_len: a stop inside the run ends the request there), and rolls back the KV of the
  rejected proposals: num_computed_tokens counts only the rows whose inputs were right, and the
  blocks that hold nothing but rejected rows go back to the pool (the runner is told to drop
  them from its table). Only computed positions ever enter the prefix cache.

A draft model (method "draft_model") proposes in the worker, not here: the scheduler gives
such a request k rows of DRAFT_PENDING, and the worker's drafter (worker/draft_model.py) fills
them with the draft's tokens before the target's forward pass of the same step. The core
counts acceptance from how many tokens come back, so it never needs their values.

A structured-output request speculates with the n-gram proposer: its grammar decides each
row's mask as decoding would. `propose` keeps the proposals while the grammar takes them
(cut before one it forbids or one that ends it: neither could be followed by a counted row),
checked on the request's matcher, which is rolled back at once. After the schedule,
`StructuredOutputManager.fill_bitmask` gives the request's first row its mask as before and
appends one bitmask row per proposal (the mask after the proposals before it: the matcher is
advanced over them, then rolled back), in the layout worker/spec_decode.py's
`grammar_proposal_rows` reads; the worker masks all 1 + k rows. Row j's mask only matters when
proposals 0..j-1 were accepted, and then it is the mask decoding one by one would give, so the
tokens stay those of decoding. The scheduler then feeds the emitted tokens to the matcher one
by one (core/stop_check.py), as without speculation: the matcher is never left advanced over a
rejected proposal. With a draft model a structured request gets no proposals: they are made
in the worker after the core built the step's masks.

It pays or it steps aside (the proposals only decide speed, never tokens): each request's
proposal count adapts to what it had accepted -- one more than its last draft's accepted run,
up to k -- and a request whose last MISS_LIMIT drafts had nothing accepted sits out a number
of steps (doubling, up to MAX_BACKOFF) before it tries again. A whole step speculates not at
all from disable_by_batch_size running requests on, nor while verifying costs more time than
the accepted tokens save: the core reports each step's whole time (`observe_step`) and
core/spec_cost.py compares tokens per second with and without, probing both now and then.

No proposals (the request decodes one token, as without speculation) for: a structured-output
request with a draft model (above), a request the n-gram does not match (or whose grammar
forbids its first proposal), and every request of a step that runs `disable_by_batch_size`
requests or more.
Stop strings are the front-end's: it cuts a step's tokens at the one that completes one.
"""
from __future__ import annotations

import numpy as np

from tidal.core.request import Request
from tidal.core.spec_cost import SpecCost
from tidal.protocol import envs
from tidal.protocol.messages import SchedulerOutput
from tidal.protocol.speculative import SpeculativeConfig

# Stop strings are checked on text by the front-end: with several tokens a step, it ends the
# output at the token that completes one (IncrementalDetokenizer.step_tokens), so requests with
# stop strings speculate too.
PROPOSE_WITH_STOP_STRINGS = True

# A proposal slot the worker's draft model fills (never a token id: ids are >= 0).
DRAFT_PENDING = -1
# Drafts in a row with nothing accepted before a request sits out; its first and longest sit-out.
MISS_LIMIT = 3
FIRST_BACKOFF = 8
MAX_BACKOFF = 64


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's NgramProposer rule: the longest n in [min_n, max_n] whose last-n-token suffix of
    `tokens` occurs earlier in them (an occurrence may overlap the suffix, not be it); of the
    occurrences of that n, the earliest; the up to k tokens that follow it. [] when none."""
    total = len(tokens)
    if k <= 0 or total < min_n + 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # Occurrences start at i with i + n <= total - 1 (so at least one token follows).
        cand = np.flatnonzero(tokens[: total - n] == suffix[0])
        for j in range(1, n):
            if not len(cand):
                break
            cand = cand[tokens[cand + j] == suffix[j]]
        if len(cand):
            start = int(cand[0]) + n
            return tokens[start: start + k].tolist()
    return []


class SpecDecoder:
    """The scheduler's proposer and its counters (vLLM's spec_decode_* metric names)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        # Cumulative, as vLLM's SpecDecodingStats: requests given proposals (one draft each per
        # step), proposals made, proposals accepted, and acceptances by proposal position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k
        self.cost = SpecCost()
        # Pause speculation in steps where it costs more time than it saves (read once: the
        # process's environment, inherited by a core restarted after a crash).
        self.cost_aware = bool(envs.TIDAL_SPEC_COST_RULE)
        self._step_accepted = 0  # accepted in the step being applied (for observe_step)
        self._paused = False  # this step's cost rule said: no proposals (see propose)

    def step_enabled(self, num_running: int) -> bool:
        """Whether any request gets proposals in a step that runs `num_running` requests (then
        the cost rule decides which: see propose)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return False
        self._paused = self.cost_aware and not self.cost.speculate(num_running)
        return True

    def observe_step(self, so: SchedulerOutput, seconds: float) -> None:
        """The core ran `so` in `seconds` (its results applied: `record` saw its drafts).
        Only pure decode steps are measured: a prefill chunk's cost would swamp the comparison."""
        accepted, self._step_accepted = self._step_accepted, 0
        if so.scheduled_new_reqs:
            return
        spec = so.scheduled_spec_decode_tokens
        num_proposals = 0
        for rid, n in so.num_scheduled_tokens.items():
            k = len(spec.get(rid, ())) if spec else 0
            if n - k != 1:
                return  # a prefill chunk
            num_proposals += k
        self.cost.observe(seconds, len(so.num_scheduled_tokens), num_proposals, accepted)

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Proposals for a decoding request (its last token is the one to compute): at most
        `max_tokens`, none past what the request may still emit (max_tokens, max_model_len)."""
        if self._paused and request.spec_k is not None:
            # Speculation does not pay now (core/spec_cost.py). A request's first draft still
            # runs: acceptance is the request's own (one copying its prompt takes nearly all).
            return []
        if request.spec_skip > 0:  # sitting out after drafts that were all rejected
            request.spec_skip -= 1
            return []
        k = min(self.k if request.spec_k is None else request.spec_k, max_tokens,
                request.max_tokens - request.num_output_tokens - 1,  # the bonus token is the last allowed
                self.max_model_len - 1 - request.num_tokens)
        cfg = self.config
        if k <= 0 or not eligible(request, cfg.method):
            return []
        if cfg.method == "draft_model":
            return [DRAFT_PENDING] * k
        tokens = np.asarray(request.all_token_ids, dtype=np.int64)
        proposals = ngram_propose(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)
        so = request.structured_output_request
        if proposals and so is not None:
            # Rows after a proposal the grammar forbids (or ends on) would never count: none.
            proposals = proposals[: so.num_valid_proposals(proposals)]
        return proposals

    def record(self, num_draft_tokens: int, num_accepted: int, request: Request | None = None) -> None:
        """Count a verified draft, and adapt `request`'s next proposal count to it."""
        if request is not None:
            self._adapt(request, num_draft_tokens, num_accepted)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self._step_accepted += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1

    def _adapt(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        request.spec_k = min(self.k, num_accepted + 1)
        if num_accepted:
            request.spec_misses, request.spec_backoff = 0, 0
            return
        request.spec_misses += 1
        if request.spec_misses >= MISS_LIMIT:
            request.spec_backoff = min(MAX_BACKOFF, 2 * request.spec_backoff or FIRST_BACKOFF)
            request.spec_skip, request.spec_misses = request.spec_backoff, 0


def eligible(request: Request, method: str) -> bool:
    """Whether speculation can be verified exactly for this request (see the module's list)."""
    so = request.structured_output_request
    if so is not None and (method == "draft_model" or not so.ready):
        return False
    return PROPOSE_WITH_STOP_STRINGS or not request.sampling_params.stop
