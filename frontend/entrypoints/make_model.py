"""Make small Hugging Face checkpoints offline, in seconds: tests and the embedded default model.

A byte-level BPE tokenizer is trained with the `tokenizers` library on a fixed slice of Python's
own standard library sources (cached per vocab size), and a Llama/Mistral/Qwen2/Qwen3/Phi-3 or
Qwen3-MoE/Mixtral model with seeded random weights is built with `transformers` and saved as
safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from tidal.protocol import envs

SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN, PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|endoftext|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The models' chat template: CHATML_TEMPLATE's rendering for plain messages, character for
# character, and Qwen3's tool calling (Hermes format, which `--tool-call-parser hermes` reads):
# the tools listed in the system turn with <tool_call> instructions, an assistant's tool_calls
# as <tool_call>{"name": ..., "arguments": ...}</tool_call> (arguments a dict, as vLLM passes
# them, or JSON text), tool results as <tool_response> in a user turn, an assistant's
# reasoning_content in <think>, and enable_thinking=false closing an empty <think> block after
# the generation prompt (so a model answers without thinking, as Qwen3's template does).
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{- '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}"
    "{%- endif %}"
    "{{- message['content'] }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

DEFAULT_ARCH = "qwen3"
# Tiny Qwen3 shape for the embedded default model (~4M parameters, made in ~1 s).
DEFAULT_MODEL_KWARGS: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)

# Bump when the corpus recipe or trainer settings change, so caches are rebuilt.
_TOKENIZER_VERSION = 1
_CORPUS_BYTES = 2 << 20

_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
ARCH_NAMES = list(_ARCHS)  # make_model's `arch` values (the CLI's --arch choices)


def default_model_dir() -> str:
    return os.path.join(envs.TIDAL_CACHE_DIR, "default-model")


def training_corpus(max_chars: int = _CORPUS_BYTES) -> list[str]:
    """The first ~`max_chars` characters of the sorted top-level stdlib modules, file by file:
    deterministic per Python build (also the tests' code corpus)."""
    stdlib = os.path.dirname(os.__file__)
    texts: list[str] = []
    total = 0
    for name in sorted(os.listdir(stdlib)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


def train_tokenizer_json(vocab_size: int) -> str:
    """Path of a cached tokenizer.json (byte-level BPE, `vocab_size` entries incl. specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level tokenizer")
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    folder = os.path.join(envs.TIDAL_CACHE_DIR, "tokenizers", f"bytebpe-v{_TOKENIZER_VERSION}-py{py}-{vocab_size}")
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text round-trips
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    tok.save(tmp)
    os.replace(tmp, path)  # atomic: concurrent makers never see a partial file
    return path


def write_tokenizer(out_dir: str, vocab_size: int, tokenizer_dir: str | None = None) -> int:
    """Write HF tokenizer files into out_dir; returns the tokenizer's vocabulary size."""
    from tokenizers import Tokenizer

    src = os.path.join(tokenizer_dir, "tokenizer.json") if tokenizer_dir else train_tokenizer_json(vocab_size)
    shutil.copyfile(src, os.path.join(out_dir, "tokenizer.json"))
    tok = Tokenizer.from_file(src)
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [EOS_TOKEN, "<|im_start|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": TOOL_CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special_map, f, indent=2)
    return tok.get_vocab_size()


def make_model(
    out_dir: str,
    arch: str = DEFAULT_ARCH,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    init_std: float = 0.1,
    max_shard_size: int | str | None = None,
    dtype: str = "float32",
    tokenizer_dir: str | None = None,
    config_overrides: dict[str, Any] | None = None,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    sliding_window: int | None = None,
) -> str:
    """Write a complete HF checkpoint (config, safetensors, tokenizer, generation config).

    init_std is the normal std of every linear/embedding weight. 0.1 (5x HF's default) gives
    logits with top-1/top-2 gaps far above float32 noise, so greedy comparisons against
    transformers are not decided by near-ties. tie_word_embeddings defaults to True for the
    Qwen and Gemma archs and False for Llama/Mistral, as the published small models do.
    sliding_window: every layer attends over that many positions (Mistral, Phi-3; Qwen2/Qwen3 with
    use_sliding_window and max_window_layers 0, which config_overrides can raise); None: full.
    Gemma 2/3 alternate local layers (that window; None: the whole context) with global ones.
    The MoE archs (qwen3_moe, mixtral) take num_experts experts, num_experts_per_tok of them
    per token; moe_intermediate_size is each Qwen3-MoE expert's width (default hidden_size;
    a Mixtral expert is intermediate_size wide). Qwen3-MoE's other fields (norm_topk_prob,
    decoder_sparse_step, mlp_only_layers) go through config_overrides.
    Returns out_dir.
    """
    import torch
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(_ARCHS)}")
    os.makedirs(out_dir, exist_ok=True)
    tok_vocab = write_tokenizer(out_dir, vocab_size, tokenizer_dir)
    if tok_vocab > vocab_size:
        raise ValueError(f"tokenizer has {tok_vocab} tokens but vocab_size is {vocab_size}")
    ids = {t: SPECIAL_TOKENS.index(t) for t in SPECIAL_TOKENS}

    config_name, model_name = _ARCHS[arch]
    if tie_word_embeddings is None:
        tie_word_embeddings = arch.startswith(("qwen", "gemma"))
    cfg: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        hidden_act="silu",
        use_cache=True,
    )
    if arch in ("mistral", "mixtral", "phi3"):
        cfg["sliding_window"] = sliding_window  # MistralConfig's default would be 4096
    elif arch in ("qwen2", "qwen3") and sliding_window is not None:
        cfg.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
    elif arch in ("gemma2", "gemma3"):
        # Gemma's own activation and query scale; local layers alternate with global ones
        # (transformers' default pattern), their window sliding_window or, unset, the context.
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg["head_dim"],
                   sliding_window=sliding_window or max_position_embeddings)
    elif sliding_window is not None:
        raise ValueError(f"make_model gives {arch} no sliding window")
    if arch == "qwen3_moe":
        cfg.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                   moe_intermediate_size=moe_intermediate_size or hidden_size)
    elif arch == "mixtral":
        cfg.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    elif arch == "phi3":  # Phi3Config keeps the pre-training context at the top level (default 4096)
        cfg["original_max_position_embeddings"] = int((rope_scaling or {}).get("original_max_position_embeddings")
                                                      or max_position_embeddings)
    cfg.update(config_overrides or {})
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    config = getattr(transformers, config_name)(**cfg)
    config.architectures = [model_name]

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):  # HF zero-inits biases; random ones make bias loading testable
                    param.normal_(0.0, init_std)
    model = model.to(torch_dtype).eval()
    model.config.dtype = torch_dtype
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    hf_logging = transformers.utils.logging
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar per test model is noise
    try:
        model.save_pretrained(out_dir, **save_kwargs)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    transformers.GenerationConfig(
        bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN]
    ).save_pretrained(out_dir)
    return out_dir


def _refresh_chat_template(model_dir: str) -> None:
    """A default model made by an earlier tidal gets today's chat template (its weights and
    tokenizer are unchanged): the tool-calling one, not the plain ChatML of older releases."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return
    if config.get("chat_template") == TOOL_CHAT_TEMPLATE:
        return
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def ensure_default_model() -> str:
    """Make the embedded default model once per cache dir and return its path.

    Built in a sibling temp dir and renamed into place, so a reader never sees a half-written
    model and concurrent first runs do not corrupt each other.
    """
    final = default_model_dir()
    if os.path.isfile(os.path.join(final, "config.json")):
        _refresh_chat_template(final)
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".default-model-", dir=parent)
    try:
        make_model(tmp, DEFAULT_ARCH, **DEFAULT_MODEL_KWARGS)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise  # not a lost race: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
