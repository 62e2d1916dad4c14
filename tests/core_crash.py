"""Test-only engine core that dies (SIGKILL, as a segfault or the OOM killer would end it)
whenever it samples for a request whose prompt holds a given token: a request that
deterministically crashes the core, for the restart tests.

`use_crashing_core(monkeypatch, TOKEN)` makes every core a front-end spawns run as
`python tests/core_crash.py TOKEN <core_proc arguments>`.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest


def use_crashing_core(monkeypatch: "pytest.MonkeyPatch", token_id: int) -> None:
    from tidal.frontend.core_process import CoreProcess

    monkeypatch.setattr(CoreProcess, "core_entry", (os.path.abspath(__file__), str(token_id)))


def main(argv: list[str]) -> None:
    from tidal.core import core_proc
    from tidal.worker.model_runner import ModelRunner

    token_id, sample = int(argv[0]), ModelRunner._sample

    def crashing_sample(self: Any, batch: Any, logits: Any, out: Any) -> None:
        for i in batch.sample_rows:
            st = self.requests[batch.req_ids[i]]
            if token_id in st.token_ids[: st.num_prompt_tokens]:
                os.kill(os.getpid(), signal.SIGKILL)
        sample(self, batch, logits, out)

    ModelRunner._sample = crashing_sample  # type: ignore[method-assign]
    core_proc.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
