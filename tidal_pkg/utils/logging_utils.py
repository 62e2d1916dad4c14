"""Logging of tidal's processes: root logging setup (TIDAL_LOG_LEVEL, TIDAL_LOGGING_CONFIG_PATH),
logging.config files, and exceptions summarized in one log line."""
from __future__ import annotations

import json
import logging
import logging.config
import os
import traceback
from typing import Any

from tidal.protocol import envs


def setup_logging(process_label: str) -> None:
    """Root logging for a tidal process at TIDAL_LOG_LEVEL, each line naming the process; or
    the logging config in TIDAL_LOGGING_CONFIG_PATH when that is set."""
    if envs.TIDAL_LOGGING_CONFIG_PATH is not None:
        apply_logging_config(load_logging_config(envs.TIDAL_LOGGING_CONFIG_PATH))
        return
    logging.basicConfig(
        level=envs.TIDAL_LOG_LEVEL.upper(),
        format=f"%(asctime)s %(levelname)s [{process_label} %(process)d] %(name)s: %(message)s")


def load_logging_config(path: str) -> dict[str, Any]:
    """A JSON logging.config dict from `path`; ValueError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"logging config {path!r}: {type(e).__name__}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"logging config {path!r}: expected a JSON object (a logging.config dict)")
    return config


def apply_logging_config(config: dict[str, Any]) -> None:
    """dictConfig, keeping loggers the config does not name (dictConfig's own default would
    silence every logger created before it: the engine's, uvicorn's)."""
    logging.config.dictConfig({"disable_existing_loggers": False, **config})


def format_frames(frames: list[traceback.FrameSummary]) -> str:
    """Innermost frame first: "file.py:12 fn <- caller.py:34 caller"."""
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


def summarize_exception(e: BaseException, frames: int = 3) -> str:
    """The exception and where it happened (its last frames), short enough for one log line."""
    where = format_frames(traceback.extract_tb(e.__traceback__)[-frames:])
    return f"{type(e).__name__}: {e} (at {where})" if where else f"{type(e).__name__}: {e}"
