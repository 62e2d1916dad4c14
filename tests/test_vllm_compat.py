"""vLLM users' scripts, run as written: vLLM's docs quickstart for `LLM`, its
examples/offline_inference/async_llm_streaming.py and (the body of) basic/chat.py, with `vllm`
replaced by `tidal` (module paths and names alike) and the test model's directory for the hub
name; then vLLM's seed, cache_salt and prompt-dict conventions offline."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

QUICKSTART = '''
from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="facebook/opt-125m")

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''

ASYNC_STREAMING = '''
import asyncio

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> None:
    print(f"\\n🚀 Prompt: {prompt!r}")
    print("💬 Response: ", end="", flush=True)

    # Configure sampling parameters for streaming
    sampling_params = SamplingParams(
        max_tokens=100,
        temperature=0.8,
        top_p=0.95,
        seed=42,  # For reproducible results
        output_kind=RequestOutputKind.DELTA,  # Get only new tokens each iteration
    )

    try:
        # Stream tokens from AsyncLLM
        async for output in engine.generate(
            request_id=request_id, prompt=prompt, sampling_params=sampling_params
        ):
            # Process each completion in the output
            for completion in output.outputs:
                # In DELTA mode, we get only new tokens generated since last iteration
                new_text = completion.text
                if new_text:
                    print(new_text, end="", flush=True)

            # Check if generation is finished
            if output.finished:
                print("\\n✅ Generation complete!")
                break

    except Exception as e:
        print(f"\\n❌ Error during streaming: {e}")
        raise


async def main():
    print("🔧 Initializing AsyncLLM...")

    # Create AsyncLLM engine with simple configuration
    engine_args = AsyncEngineArgs(
        model="meta-llama/Llama-3.2-1B-Instruct",
        enforce_eager=True,  # Faster startup for examples
    )
    engine = AsyncLLM.from_engine_args(engine_args)

    try:
        # Example prompts to demonstrate streaming
        prompts = [
            "The future of artificial intelligence is",
            "In a galaxy far, far away",
            "The key to happiness is",
        ]

        print(f"🎯 Running {len(prompts)} streaming examples...")

        # Process each prompt
        for i, prompt in enumerate(prompts, 1):
            print(f"\\n{'=' * 60}")
            print(f"Example {i}/{len(prompts)}")
            print(f"{'=' * 60}")

            request_id = f"stream-example-{i}"
            await stream_response(engine, prompt, request_id)

            # Brief pause between examples
            if i < len(prompts):
                await asyncio.sleep(0.5)

        print("\\n🎉 All streaming examples completed!")

    finally:
        # Always clean up the engine
        print("🔧 Shutting down engine...")
        engine.shutdown()
'''

def as_tidal(script: str, hub_name: str, model_dir: str) -> str:
    """The script with `vllm` replaced by `tidal` (modules and names alike, as a user would) and
    the hub model by the test model's directory."""
    script = script.replace(f'"{hub_name}"', repr(model_dir))
    return script.replace("vllm", "tidal")


def test_quickstart(tiny_model_dir: str, capsys: Any) -> None:
    namespace: dict[str, Any] = {}
    exec(as_tidal(QUICKSTART, "facebook/opt-125m", tiny_model_dir), namespace)
    namespace["llm"].shutdown()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Prompt: ")]
    assert [line.split(", Generated text: ")[0] for line in lines] == [f"Prompt: {p!r}" for p in namespace["prompts"]]
    for o in namespace["outputs"]:  # sampled: EOS may come before vLLM's default max_tokens (16)
        c = o.outputs[0]
        assert (c.finish_reason, len(c.token_ids)) == ("length", 16) or c.finish_reason == "stop"


def test_async_llm_streaming_example(tiny_model_dir: str, capsys: Any) -> None:
    namespace: dict[str, Any] = {"__name__": "async_llm_streaming"}
    exec(as_tidal(ASYNC_STREAMING, "meta-llama/Llama-3.2-1B-Instruct", tiny_model_dir), namespace)
    asyncio.run(namespace["main"]())
    out = capsys.readouterr().out
    assert out.count("✅ Generation complete!") == 3 and "🎉 All streaming examples completed!" in out
    assert "❌" not in out and out.rstrip().endswith("🔧 Shutting down engine...")


# vLLM's examples/offline_inference/basic/chat.py, the body of its main() with its argument
# parsing replaced by literals (the sampling settings greedy, so that outputs compare).
CHAT_EXAMPLE = '''
from vllm import LLM, SamplingParams

sampling_params = SamplingParams(max_tokens=8, temperature=0)
llm = LLM(model="meta-llama/Llama-3.2-1B-Instruct")

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)

conversations = [conversation for _ in range(10)]
batch_outputs = llm.chat(conversations, sampling_params, use_tqdm=True)

chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
template_outputs = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template)
'''


def test_chat_example(tiny_model_dir: str) -> None:
    """LLM.chat renders as transformers renders the same conversation, tokenizes without adding
    special tokens (the template writes them), and generates as generate() does."""
    from transformers import AutoTokenizer

    namespace: dict[str, Any] = {}
    exec(as_tidal(CHAT_EXAMPLE, "meta-llama/Llama-3.2-1B-Instruct", tiny_model_dir), namespace)
    llm, conversation = namespace["llm"], namespace["conversation"]
    try:
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        expected = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        (out,) = namespace["outputs"]
        assert out.prompt == expected
        assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
        assert len(out.outputs[0].token_ids) == 8 or out.outputs[0].finish_reason == "stop"
        assert [o.outputs[0].token_ids for o in namespace["batch_outputs"]] == [out.outputs[0].token_ids] * 10
        ref = llm.generate({"prompt_token_ids": out.prompt_token_ids}, namespace["sampling_params"], use_tqdm=False)
        assert ref[0].outputs[0].token_ids == out.outputs[0].token_ids
        own = tok.apply_chat_template(conversation, chat_template=namespace["chat_template"], tokenize=False)
        assert {o.prompt for o in namespace["template_outputs"]} == {own}
    finally:
        llm.shutdown()


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_model_dir: str) -> None:
    """vLLM's seed (default 0): the same requests in the same order sample the same tokens in
    every run; another engine seed, other tokens."""
    from tidal import LLM, SamplingParams

    def run(seed: int) -> list[list[int]]:
        with LLM(model=tiny_model_dir, seed=seed, max_model_len=256, num_kv_blocks=64) as llm:
            outs = llm.generate(["a", "b", "a"], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

    first, again, other = run(0), run(0), run(1)
    assert first == again
    assert first[0] != first[2]  # two requests draw two seeds
    assert other != first


def test_cache_salt_prompt_key(tiny_model_dir: str) -> None:
    """TokensPrompt's cache_salt: only requests with the same salt hit each other's blocks."""
    from tidal import LLM, SamplingParams, TokensPrompt

    ids = list(range(5, 5 + 40))
    params = SamplingParams(max_tokens=1)
    with LLM(model=tiny_model_dir, max_model_len=256, num_kv_blocks=64, block_size=16) as llm:
        def cached(prompt: TokensPrompt) -> int:
            return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

        assert cached(TokensPrompt(prompt_token_ids=ids, cache_salt="a")) == 0
        assert cached(TokensPrompt(prompt_token_ids=ids, cache_salt="a")) == 32  # (40 - 1) // 16 full blocks
        assert cached(TokensPrompt(prompt_token_ids=ids, cache_salt="b")) == 0
        assert cached(TokensPrompt(prompt_token_ids=ids)) == 0
        assert cached({"prompt_token_ids": ids, "multi_modal_data": None}) == 32  # vLLM's key, left empty
        with pytest.raises(ValueError, match="text-only"):
            llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": "x"}}, params)
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt_token_ids": ids, "cache_salt": ""}, params)
        out = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
    # vLLM's fields for features tidal lacks read as vLLM's "none"
    assert (out.lora_request, out.encoder_prompt, out.kv_transfer_params, dict(out.multi_modal_placeholders),
            out.outputs[0].lora_request) == (None, None, None, {}, None)


# vLLM's SamplingParams field order up to prompt_logprobs (vllm/sampling_params.py): a vLLM
# Struct without kw_only, so `SamplingParams(n, ...)` is positional there, and is here.
VLLM_POSITIONAL = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                   "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
                   "logprobs", "prompt_logprobs")


def test_sampling_params_positional_order_is_vllms() -> None:
    from tidal import SamplingParams

    values = (3, 0.1, 0.2, 1.1, 0.7, 0.9, 5, 0.05, 42, ["x"], [3], True, 9, 1, 2, 1)
    p = SamplingParams(*values)
    assert tuple(getattr(p, name) for name in VLLM_POSITIONAL) == values
    assert SamplingParams(4, temperature=0.6).n == 4  # the form seen in users' code


def test_generate_priority_forms_are_vllms(tiny_model_dir: str) -> None:
    """vLLM's tests/entrypoints/llm/test_generate.py::test_multiple_priority: one int for every
    prompt or one per prompt; a list of another length is a VLLMValidationError (a ValueError
    naming the parameter), as is a sampling-params list of another length."""
    from tidal import LLM, SamplingParams
    from tidal.exceptions import VLLMValidationError

    prompts = ["a b", "c d", "e f"]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with LLM(model=tiny_model_dir, max_model_len=128, num_kv_blocks=32, scheduling_policy="priority") as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for priority in (None, 1, [0, 1, 2]):
            outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
            assert [o.outputs[0].token_ids for o in outs] == reference
        assert len(llm.generate(prompts[0], params, use_tqdm=False, priority=1)) == 1
        for bad in ([0, 0], []):
            with pytest.raises(VLLMValidationError, match="priorities for 3 prompts") as info:
                llm.generate(prompts, params, use_tqdm=False, priority=bad)
            assert info.value.parameter == "priority" and isinstance(info.value, ValueError)
        with pytest.raises(VLLMValidationError, match="2 sampling params for 3 prompts"):
            llm.generate(prompts, [params, params], use_tqdm=False)


def test_vllm_module_paths_and_cli_parser(tiny_model_dir: str) -> None:
    """vLLM's import paths its own tests use (vllm.config, vllm.usage.usage_lib,
    vllm.utils.argparse_utils, vllm.transformers_utils.tokenizer, vllm.version,
    vllm.v1.engine.exceptions), and vLLM's parser taking underscore flags: what
    tests/v1/engine/test_engine_args.py::test_prefix_caching_from_cli does."""
    from transformers import AutoTokenizer

    import tidal
    from tidal.config import VllmConfig
    from tidal.engine.arg_utils import EngineArgs
    from tidal.protocol import EngineDeadError
    from tidal.transformers_utils.tokenizer import get_tokenizer
    from tidal.usage.usage_lib import UsageContext
    from tidal.utils.argparse_utils import FlexibleArgumentParser
    from tidal.v1.engine.exceptions import EngineDeadError as ShimDead
    from tidal.version import __version__

    assert ShimDead is EngineDeadError and __version__ == tidal.__version__
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_args([])).replace(model=tiny_model_dir).create_engine_config(
        UsageContext.LLM_CLASS)
    assert isinstance(config, VllmConfig) and config.cache_config.enable_prefix_caching
    args = parser.parse_args(["--no-enable-prefix-caching", "--max_model_len=96", "--block_size", "32"])
    config = EngineArgs.from_cli_args(args).replace(model=tiny_model_dir).create_engine_config()
    assert (config.cache_config.enable_prefix_caching, config.max_model_len, config.cache_config.block_size) == (
        False, 96, 32)
    text = "def f(x): return x + 1"
    assert get_tokenizer(tiny_model_dir).encode(text) == AutoTokenizer.from_pretrained(tiny_model_dir).encode(text)


def test_model_config_platform_and_legacy_flag_at_vllm_paths(tiny_model_dir: str) -> None:
    """vLLM's tests make a ModelConfig on its own from engine args, ask
    vllm.platforms.current_platform for the device, and wrap their LLM fixture in
    LLM.deprecate_legacy_api(); each works at tidal's path."""
    import torch

    from tidal import LLM
    from tidal.config import ModelConfig
    from tidal.platforms import current_platform

    mc = ModelConfig(model=tiny_model_dir, tokenizer=tiny_model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                     seed=0, max_model_len=96)
    assert (mc.model, mc.max_model_len, mc.seed, mc.dtype, mc.skip_tokenizer_init) == (
        tiny_model_dir, 96, 0, torch.bfloat16, True)
    with pytest.raises(TypeError, match="max_modle_len"):
        ModelConfig(model=tiny_model_dir, max_modle_len=96)
    assert current_platform.is_cuda() == torch.cuda.is_available() != current_platform.is_cpu()
    assert current_platform.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not current_platform.is_rocm()
    assert LLM.DEPRECATE_LEGACY is False
    with LLM.deprecate_legacy_api():
        assert LLM.DEPRECATE_LEGACY is True
    assert LLM.DEPRECATE_LEGACY is False
