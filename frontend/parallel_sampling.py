"""n > 1 requests (vLLM V1's parallel_sampling.py): one parent, n children in the core."""
from __future__ import annotations

import msgspec

from tidal.protocol.messages import EngineCoreRequest
from tidal.protocol.outputs import CompletionOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """An n > 1 request fanned out to n children `f"{index}_{parent_id}"`, child i seeded
    `seed + i`; aggregates their CompletionOutputs under the parent's id."""

    __slots__ = ("request_id", "sampling_params", "child_requests", "output_aggregator", "stats_left",
                 "max_generation_tokens")

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id, self.sampling_params = request_id, sampling_params
        self.child_requests: set[str] = set()  # children not finished yet
        self.output_aggregator: list[CompletionOutput | None] = [None] * sampling_params.n
        # Stats, per user request as vLLM's request_params_n / request_max_num_generation_tokens:
        # children whose finish is not recorded yet, and the most tokens a recorded one made.
        self.stats_left = sampling_params.n
        self.max_generation_tokens = 0

    def finish_stats(self, num_generation_tokens: int) -> bool:
        """Count one child's finish in the stats; whether it was the last (the parent's turn)."""
        self.stats_left -= 1
        self.max_generation_tokens = max(self.max_generation_tokens, num_generation_tokens)
        return self.stats_left == 0

    def make_children(self, request: EngineCoreRequest) -> list[EngineCoreRequest]:
        """The n child `EngineCoreRequest`s of the parent's (processed) request: copies of it
        (every field, e.g. cache_salt) but for their ids and params."""
        seed, children = self.sampling_params.seed, []
        for i in range(self.sampling_params.n):
            params = self.sampling_params.clone(n=1, seed=None if seed is None else seed + i)
            children.append(msgspec.structs.replace(request, request_id=f"{i}_{self.request_id}",
                                                    sampling_params=params))
        self.child_requests.update(c.request_id for c in children)
        return children

    def get_outputs(self, child_request_id: str,
                    completion: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """(outputs to emit now, whether the parent is finished)."""
        if completion.finish_reason is not None:
            self.child_requests.discard(child_request_id)
        finished = not self.child_requests
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion], finished
        self.output_aggregator[completion.index] = completion
        if not finished:
            return [], False
        return [c for c in self.output_aggregator if c is not None], True
