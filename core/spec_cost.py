"""Whether speculating pays in a step (torch-free): tokens per second with and without.

A step that verifies proposals costs more than a plain decode step of the same batch (on CPU
1.2-3x, more at batch 8-32), and gains 1 + (accepted / decode rows) tokens per decode row. So
speculation pays only while gain > cost ratio. Both are measured, not assumed: the core reports
each pure decode step's time and shape (`observe`), and per batch-size bucket this keeps the
last plain steps' times, the last speculative steps' times and their gains.

The rule (`speculate`), per bucket:
- too little measured yet: MIN_STEPS speculative steps, then MIN_STEPS plain ones;
- gain > ratio * (1 + MARGIN): speculate, but every PLAIN_PROBE steps with no plain step seen
  (a draft model proposes for every request), one plain step keeps the plain time fresh;
- else: plain, but now and then one speculative step re-measures gain and cost, so a change in
  acceptance (or in cost) turns it back on. The first probe comes SPEC_PROBE steps after the
  last speculative step; each probe that loses doubles the wait (up to MAX_SPEC_PROBE), as a
  probe can cost several plain steps (a draft model catching up, a verify step 3-10x a plain
  one on CPU), and one that would pay on its own brings the next one back to SPEC_PROBE, so
  a change is seen within MAX_SPEC_PROBE + a few SPEC_PROBE steps.
Proposals only decide speed, never tokens, so this rule cannot change an output.
The time is the core's whole step, from scheduling to the applied results: the proposals, a
draft model's passes, the target's forward, sampling and the update all count.
TIDAL_SPEC_COST_RULE=0 turns the rule off (core/spec_decode.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

WINDOW = 5         # estimates are over each kind's last WINDOW steps in the bucket (a change
                   # shows once 3 of them see it)
MIN_STEPS = 3      # steps of each kind measured before the rule decides
MARGIN = 0.05      # speculate only when it is clearly ahead: the estimates are noisy
PLAIN_PROBE = 16   # while speculating: a plain step at least this often (costs <= 1/16 of the gain)
SPEC_PROBE = 16    # while paused: the first probe this many steps after the last speculative step
MAX_SPEC_PROBE = 256  # ... and the longest wait between probes that keep losing


def bucket(num_rows: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: costs differ across buckets, barely within one."""
    return max(num_rows, 1).bit_length()


@dataclass
class _Bucket:
    # Step times are noisy upwards (a shared CPU, a batch shape run for the first time can take
    # 10x): the median of the last steps ignores such spikes. Gains have no spikes: the mean.
    plain_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # plain decode steps
    spec_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))   # speculative steps
    gain: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))     # 1 + accepted / rows
    since_plain: int = 0  # pure decode steps since the last plain / speculative one
    since_spec: int = 0
    probe_every: int = SPEC_PROBE  # while paused: steps from one probe to the next

    def step_pays(self, seconds: float, gain: float) -> bool:
        """Whether one speculative step, on its own, beat the plain steps' median."""
        return not self.plain_s or gain > seconds / median(self.plain_s) * (1 + MARGIN)

    def pays(self) -> bool:
        ratio = median(self.spec_s) / median(self.plain_s)
        return sum(self.gain) / len(self.gain) > ratio * (1 + MARGIN)


class SpecCost:
    """Running estimates per batch-size bucket, and the decision they give."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.num_paused_steps = 0  # steps the rule made plain (a counter for tests and logs)

    def speculate(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` decoding requests should make proposals."""
        b = self.buckets.get(bucket(num_rows))
        # A median needs 3 steps to ignore a spike (a cold start's first steps often are).
        if b is None or len(b.spec_s) < MIN_STEPS:
            return True
        if len(b.plain_s) < MIN_STEPS:
            on = False
        elif b.pays():
            on = b.since_plain < PLAIN_PROBE
        else:
            on = b.since_spec >= b.probe_every
        self.num_paused_steps += not on
        return on

    def observe(self, seconds: float, num_rows: int, num_proposal_rows: int, num_accepted: int) -> None:
        """A pure decode step (no prefill rows) of `num_rows` requests took `seconds`;
        `num_proposal_rows` proposals were verified in it, `num_accepted` of them accepted."""
        if num_rows <= 0 or seconds <= 0:
            return
        b = self.buckets.setdefault(bucket(num_rows), _Bucket())
        if num_proposal_rows:
            gain = 1 + num_accepted / num_rows
            b.probe_every = SPEC_PROBE if b.step_pays(seconds, gain) else min(2 * b.probe_every, MAX_SPEC_PROBE)
            b.spec_s.append(seconds)
            b.gain.append(gain)
            b.since_plain += 1
            b.since_spec = 0
        else:
            b.plain_s.append(seconds)
            b.since_spec += 1
            b.since_plain = 0
