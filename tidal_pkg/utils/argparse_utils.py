"""vLLM's FlexibleArgumentParser: an ArgumentParser that also takes flags spelt with
underscores (`--max_model_len 512` is `--max-model-len 512`), as `vllm serve` does; the
`tidal` command line parses with it."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def dash_flags(args: Sequence[str]) -> list[str]:
    """`--a_b` and `--a_b=v` as `--a-b` and `--a-b=v`; values and anything after `--` unchanged."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + list(args[i:])
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: Any = None) -> tuple[Any, list[str]]:
        import sys

        return super().parse_known_args(dash_flags(sys.argv[1:] if args is None else args), namespace)
