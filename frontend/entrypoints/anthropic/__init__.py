"""Anthropic Messages API (POST /v1/messages) on tidal serve."""
