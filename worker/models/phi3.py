"""Phi-3 family (Phi-3 / Phi-3.5-mini, Phi-4-mini): Llama's decoder with what transformers'
Phi3ForCausalLM differs in.

- The checkpoint already holds `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up] rows)
  fused: they load into the fused parameters directly (shard id None: each rank takes its rows
  of every part), so the Llama mapping from split names never applies.
- No biases anywhere, whatever `attention_bias` says (Phi3Attention builds none).
- LongRoPE ("su" in older configs, transformers' "longrope") with the pre-training context at
  the top level (`original_max_position_embeddings`), which LlamaModel passes on; partial
  rotary (`partial_rotary_factor`, Phi-4-mini 0.75) rotates the leading dims of each head.
  Past the original context, transformers' Phi3 generate() drops its cache once and re-rotates
  every key with the long factors; tidal (as vLLM) keeps cached keys as they were rotated,
  which is transformers' model decoding token by token over its own cache.
- `sliding_window` (Phi-3-mini-4k: 2047) slides every layer (protocol/sliding_window.py).
- resid/embd/attention dropout are training-only; `pad_token_id` only zero-inits an embedding
  row: neither changes inference.
"""

from __future__ import annotations

from typing import Any

from tidal.worker.models.llama import AttentionOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _attention_options(config: Any) -> AttentionOptions:
        return AttentionOptions()
