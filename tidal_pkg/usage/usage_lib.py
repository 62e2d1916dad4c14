"""vLLM's `UsageContext`: where an engine was started from. tidal sends no usage reports; the
value is accepted wherever vLLM takes one (`create_engine_config(usage_context)`,
`from_engine_args(..., usage_context=...)`) and changes nothing."""
from enum import Enum


class UsageContext(str, Enum):
    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    API_SERVER = "API_SERVER"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
    OPENAI_BATCH_RUNNER = "OPENAI_BATCH_RUNNER"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"


__all__ = ["UsageContext"]
