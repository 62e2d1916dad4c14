"""The OpenAI-compatible HTTP server (`tidal serve`), built on AsyncLLM."""
