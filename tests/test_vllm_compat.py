"""vLLM users' scripts, run as written: vLLM's docs quickstart for `LLM` and its
examples/offline_inference/async_llm_streaming.py, verbatim except the imports (vllm -> tidal)
and the model (the test model's directory instead of a hub name)."""
from __future__ import annotations

import asyncio
from typing import Any

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

IMPORTS = {
    "from vllm import LLM, SamplingParams": "from tidal.frontend import LLM\nfrom tidal.protocol import SamplingParams",
    "from vllm import SamplingParams": "from tidal.protocol import SamplingParams",
    "from vllm.engine.arg_utils import AsyncEngineArgs": "from tidal.frontend import AsyncEngineArgs",
    "from vllm.sampling_params import RequestOutputKind": "from tidal.protocol import RequestOutputKind",
    "from vllm.v1.engine.async_llm import AsyncLLM": "from tidal.frontend import AsyncLLM",
}


def as_tidal(script: str, hub_name: str, model_dir: str) -> str:
    for vllm_import, tidal_import in IMPORTS.items():
        script = script.replace(vllm_import + "\n", tidal_import + "\n")
    assert "vllm" not in script.replace(hub_name, "")
    return script.replace(f'"{hub_name}"', repr(model_dir))


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
