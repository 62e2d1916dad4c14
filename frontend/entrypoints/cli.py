"""`tidal` command line: generate | serve | core | core-keygen | make-model.

    tidal generate [--model DIR] [--prompt TEXT] [--max-tokens N] [--temperature T] [--seed S] [engine args]
    tidal serve [MODEL] [--host H] [--port P] [--api-key K] [--chat-template FILE] [engine args]
    tidal core MODEL [--address tcp://127.0.0.1:PORT | ipc:///path] [--key-file FILE]
               [--drain-timeout-s S] [engine args]
    tidal core-keygen FILE    (a CURVE key file for `tidal core --key-file` and its front-ends)
    tidal make-model DIR [--arch qwen3|llama|qwen2|mistral|qwen3_moe|mixtral|phi3|gemma2|gemma3] [--hidden-size ...] ...
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from tidal.frontend import EngineArgs, config_from_args
from tidal.utils.argparse_utils import FlexibleArgumentParser
from tidal.utils.logging_utils import setup_logging

DEFAULT_CORE_ADDRESS = "tcp://127.0.0.1:5570"
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # core/drain.py's (not imported here: the CLI starts fast)
DEFAULT_PROMPT = "Hello, my name is"
# make-model's int options: each a --flag and a make_model keyword of the same name.
_MAKE_MODEL_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "max_position_embeddings", "seed")


def _cmd_generate(args: argparse.Namespace) -> int:
    from tidal.frontend import AsyncLLM
    from tidal.protocol import RequestOutputKind, SamplingParams

    model = args.model
    if model is None:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        model = ensure_default_model()
        print(f"note: no --model given, so this uses tidal's embedded default model ({model}). "
              "Its weights are random: the text below is gibberish.", file=sys.stderr, flush=True)
    config = config_from_args(args, model=model, **({"seed": args.seed} if args.seed is not None else {}))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, ignore_eos=args.ignore_eos,
                            output_kind=RequestOutputKind.DELTA)

    async def run() -> None:
        async with AsyncLLM.from_config(config) as engine:
            async for out in engine.generate(args.prompt, params, "cli"):
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    _run_loop(run())
    return 0


def _run_loop(coro: asyncio.Future[None] | object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.headless:
        return _cmd_headless(args)
    from tidal.frontend.entrypoints.api_servers import apply_child_settings, child_settings, run_api_servers

    if (settings := child_settings()) is not None:  # one of --api-server-count's servers
        apply_child_settings(args, settings)
        args.listen_fd = settings["fd"]
    elif args.api_server_count > 1:
        return run_api_servers(args, sys.argv[1:])
    elif args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    from tidal.frontend.entrypoints.openai.api_server import run_server

    logging.getLogger("tidal").setLevel(logging.INFO)  # the startup line and the stats log
    _run_loop(run_server(args))
    return 0


def _cmd_headless(args: argparse.Namespace) -> int:
    """`tidal serve --headless`: node K > 0 of a multi-node engine (no API server, no engine
    core): it runs its tensor-parallel ranks for the leader until SIGTERM/SIGINT."""
    import signal
    import threading

    config = config_from_args(args, model=args.model_flag or args.model or "")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("tidal").setLevel(logging.INFO)
    if config.nnodes > 1 and config.node_rank > 0:
        from tidal.core.multinode import run_node_agent

        return run_node_agent(config, stop)
    if config.data_parallel_size > 1 and (config.data_parallel_start_rank or 0) > 0:
        from tidal.core.dp_node import run_dp_node

        return run_dp_node(config, stop)
    raise ValueError("--headless runs either node --node-rank K >= 1 of a multi-node engine (--nnodes), or "
                     "data-parallel engines from --data-parallel-start-rank R >= 1 for a head at "
                     "--data-parallel-address")


def _cmd_core(args: argparse.Namespace) -> int:
    from tidal.utils.openmp import prefer_compute_process_env

    prefer_compute_process_env()  # before torch loads (with the model)
    from tidal.core.core_proc import run_engine_core
    from tidal.utils.curve import check_bind_security, load_key_file
    from tidal.utils.zmq_utils import validate_address

    # Every refusal before the model loads: a wildcard, a bind off loopback without a key, a
    # key file that is unreadable, malformed or readable by others.
    address = validate_address(args.address)
    check_bind_security(address, args.key_file)
    if args.key_file is not None:
        load_key_file(args.key_file, server=True)
    if args.drain_timeout_s < 0:
        raise ValueError(f"--drain-timeout-s must be >= 0, got {args.drain_timeout_s}")
    config = config_from_args(args, model=args.model)
    logging.getLogger("tidal").setLevel(logging.INFO)
    keyed = " (CURVE-keyed)" if args.key_file else ""
    print(f"tidal engine core: loading {args.model}; will serve at {address}{keyed}", file=sys.stderr, flush=True)
    return run_engine_core(config, address, key_file=args.key_file, drain_timeout_s=args.drain_timeout_s)


def _cmd_core_keygen(args: argparse.Namespace) -> int:
    from tidal.utils.curve import generate_key_file

    generate_key_file(args.file)
    print(f"wrote {os.path.abspath(args.file)} (mode 600): pass it as `tidal core --key-file` and as "
          "core_key_file to the front-ends", file=sys.stderr)
    return 0


def _cmd_make_model(args: argparse.Namespace) -> int:
    from tidal.frontend.entrypoints.make_model import make_model

    kwargs = {k: v for k in (*_MAKE_MODEL_INTS, "dtype") if (v := getattr(args, k)) is not None}
    path = make_model(args.dir, args.arch, **kwargs)
    print(os.path.abspath(path))
    return 0


def build_parser() -> argparse.ArgumentParser:
    # vLLM's parser: `--max_model_len` is `--max-model-len`, as under `vllm serve`.
    parser = FlexibleArgumentParser(prog="tidal", description="tidal LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion to stdout")
    gen.add_argument("--model", default=None, help="HF model dir (default: the embedded random model)")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling (and engine) seed")
    gen.add_argument("--ignore-eos", action="store_true")
    # Engine flags: every vLLM engine arg plus tidal's (--core-address: a running `tidal core`).
    EngineArgs.add_cli_args(gen, exclude=frozenset({"model", "seed"}))
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (vLLM's `vllm serve`)")
    from tidal.frontend.entrypoints.openai.cli_args import add_serve_args

    add_serve_args(serve)
    serve.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="API server processes sharing the port, each reaching every engine "
                            "(/metrics aggregated over them)")
    serve.add_argument("--headless", action="store_true",
                       help="no API server: run this node's tensor-parallel ranks for a leader (--nnodes, "
                            "--node-rank, --master-addr, --master-port), or data-parallel engines for a head "
                            "(--data-parallel-start-rank, --data-parallel-address, --data-parallel-rpc-port)")
    serve.set_defaults(func=_cmd_serve)

    core = sub.add_parser("core", help="run a headless engine core that front-ends connect to")
    core.add_argument("model")
    core.add_argument("--address", default=DEFAULT_CORE_ADDRESS,
                      help="tcp://HOST:PORT (an explicit interface, never a wildcard) or ipc:///path")
    core.add_argument("--key-file", "--core-key-file", dest="key_file", default=None,
                      help="CURVE key file (`tidal core-keygen FILE`): only front-ends holding it are "
                           "served; required to bind an address other than loopback")
    core.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                      help="on SIGTERM, refuse new requests and let those in flight finish for up to "
                           "this long before exiting (a second SIGTERM exits at once)")
    EngineArgs.add_cli_args(core, exclude=frozenset({"model", "core_key_file"}))
    core.set_defaults(func=_cmd_core)

    keygen = sub.add_parser("core-keygen", help="write a new CURVE key file for a keyed headless core")
    keygen.add_argument("file", help="where to write it (must not exist; written with mode 600)")
    keygen.set_defaults(func=_cmd_core_keygen)

    mk = sub.add_parser("make-model", help="write a tiny random HF checkpoint + tokenizer")
    mk.add_argument("dir")
    from tidal.frontend.entrypoints.make_model import ARCH_NAMES  # light: torch loads on use
    mk.add_argument("--arch", default="qwen3", choices=ARCH_NAMES)
    for name in _MAKE_MODEL_INTS:
        mk.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    mk.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    mk.set_defaults(func=_cmd_make_model)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(f"tidal {args.command}")
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # a one-line message; the traceback with TIDAL_LOG_LEVEL=DEBUG
        logging.getLogger("tidal.cli").debug("failed", exc_info=True)
        print(f"tidal {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
