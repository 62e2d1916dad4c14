"""The plan of one scheduler step: what `Scheduler.schedule` has decided so far, and the one
way a request enters it (or, when preempted later in the same step, leaves it again).

Invariants:
- `num_scheduled_tokens` has exactly the ids of `new_reqs` and `cached_reqs`; `token_budget` is
  the step's budget less their sum.
- A request enters through `enter` only, which also marks everything it has as sent to the
  runner (`Request.num_synced_tokens`, and the blocks it dropped: `num_dropped_blocks`).
- `spec_tokens` holds the speculative proposals of requests in the step (core/spec_decode.py);
  each is counted in its request's `num_scheduled_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tidal.core.request import Request
from tidal.protocol.messages import CachedRequestData, NewRequestData


@dataclass
class StepPlan:
    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    # By id, in scheduling order: a priority preemption may take one back out.
    cached_reqs: dict[str, CachedRequestData] = field(default_factory=dict)
    preempted: bool = False
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    def enter(self, request: Request, num_tokens: int, block_ids: list[int], *, new: bool,
              spec_tokens: list[int] | None = None) -> None:
        """Schedule `num_tokens` of `request` (its proposals `spec_tokens` included). new: just
        admitted (WAITING or PREEMPTED), the runner gets it whole and `block_ids` are all its
        blocks; else it runs on, the runner gets the tokens it lacks and `block_ids` are the
        blocks added this step."""
        rid = request.request_id
        if new:
            self.new_reqs.append(NewRequestData(
                req_id=rid,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                output_token_ids=list(request.output_token_ids),
                eos_token_id=request.eos_token_id,
            ))
        else:
            self.cached_reqs[rid] = CachedRequestData(
                req_id=rid,
                new_token_ids=request.all_token_ids[request.num_synced_tokens :],
                new_block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                num_dropped_blocks=request.num_dropped_blocks,
            )
        request.num_synced_tokens = request.num_tokens
        request.num_dropped_blocks = 0
        if spec_tokens:
            self.spec_tokens[rid] = spec_tokens
        self.num_scheduled_tokens[rid] = num_tokens
        self.token_budget -= num_tokens

    def take_back(self, request: Request) -> None:
        """Take a request that entered earlier this step back out (it is being preempted);
        a no-op for one not in the step."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, None)
        if num_tokens is not None:
            self.token_budget += num_tokens
            del self.cached_reqs[request.request_id]
            self.spec_tokens.pop(request.request_id, None)
