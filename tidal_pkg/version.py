"""vLLM's `vllm.version` names: the installed tidal's version."""
from tidal import __version__

__version_tuple__ = tuple(int(p) if p.isdigit() else p for p in __version__.split("."))

__all__ = ["__version__", "__version_tuple__"]
