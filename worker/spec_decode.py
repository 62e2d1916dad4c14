"""Speculative decoding in the worker: the verification rule, and the layout of a step's
sampling rows when some requests carry proposals (core/spec_decode.py has the whole design).

A request with proposals d_0..d_{k-1} computes k + 1 query rows (its last token, then d_0 ..
d_{k-1}); row j is sampled as the token at sequence position p + j (p = the request's length)
with its (seed, p + j) noise and its history extended by d_0..d_{j-1}, i.e. exactly as decoding
would sample it were those proposals its tokens. `verify` keeps the samples up to the first
that differs from its proposal: row j only counts when d_0..d_{j-1} were all accepted, and
then its inputs (KV, history, position) are those of decoding one by one. So the tokens
emitted are the ones decoding without speculation yields, greedy and seeded random alike.
A structured-output request's row j is masked with the grammar's state after d_0..d_{j-1}
(`grammar_proposal_rows`: where those masks sit in the step's bitmask), as decoding masks it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def verify(target: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens one request emits: `target[j]` is the token sampled at row j (len(draft) + 1
    rows), `draft[j]` the proposal for the same position. Proposals are accepted while they
    equal the target's token; the first mismatch is replaced by the target's token (and ends
    the run); when all are accepted, the last row's token (the bonus) comes too."""
    assert len(target) == len(draft) + 1, (len(target), len(draft))
    m = 0
    while m < len(draft) and target[m] == draft[m]:
        m += 1
    return list(target[: m + 1])


def row_layout(sample_rows: Sequence[int], spec: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """(first logits row, number of rows) of each entry of `sample_rows` (batch indices, in
    order; `spec`: batch index -> its proposals), the rows laid out one request after another."""
    firsts: list[int] = []
    counts: list[int] = []
    offset = 0
    for i in sample_rows:
        n = 1 + len(spec.get(i, ()))
        firsts.append(offset)
        counts.append(n)
        offset += n
    return firsts, counts


def grammar_proposal_rows(structured_ids: Iterable[str], spec: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """Where each constrained request's proposal masks start in a step's grammar bitmask: row
    i < len(structured_ids) masks request i's first row; then come, request after request in
    `structured_ids` order, one row per proposal of each that verifies some (`spec`: req_id ->
    its proposals), the mask of the sampling row that follows that proposal. The core builds
    this layout (StructuredOutputManager.fill_bitmask); the runners read it."""
    ids = list(structured_ids)
    rows: dict[str, int] = {}
    offset = len(ids)
    for rid in ids:
        drafts = spec.get(rid)
        if drafts:
            rows[rid] = offset
            offset += len(drafts)
    return rows
