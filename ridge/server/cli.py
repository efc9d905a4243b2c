"""``ridge serve``: the OpenAI-compatible server on uvicorn.

The listening socket is bound before the model loads, so a taken port fails at once (exit
code 2). Ctrl-C (SIGINT) or SIGTERM: uvicorn stops accepting, lets in-flight responses finish
for up to ``--graceful-shutdown-timeout`` seconds, then the app's lifespan stops the engine
loop; a second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from ridge.engine.args import add_engine_args, engine_options
from ridge.server.listen import DEFAULT_HOST, bind_socket
from ridge.tools.parsers import TOOL_PARSERS

__all__ = ["DEFAULT_HOST", "bind_socket", "register", "run_serve"]

DEFAULT_PORT = 8000


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics (Prometheus).",
    )
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free port)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $RIDGE_API_KEY, else none)",
    )
    g.add_argument(
        "--served-model-name", nargs="+", default=None, help="model name(s) clients use (default: the --model value)"
    )
    g.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="larger request bodies get a 413")
    g.add_argument(
        "--graceful-shutdown-timeout",
        type=int,
        default=10,
        help="seconds in-flight responses get to finish on shutdown",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls (hermes: Qwen2.5/3, Hermes; llama3_json: Llama 3.x): "
        "answers to tool_choice 'auto' are read with it into tool_calls",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag for tool_choice 'auto'; accepted for compatibility (--tool-call-parser enables it)",
    )
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    g.add_argument("--disable-access-log", action="store_true")
    p.set_defaults(func=run_serve)


def _kv_role_note(kv: dict | None) -> str:
    if kv is None:
        return ""
    return f", {kv['kv_role']} {kv['engine_id']} with its KV endpoint on {kv['kv_ip']}:{kv['kv_port']}"


# After a fatal engine error: time for the open streams' error events to leave before exiting.
FATAL_EXIT_DELAY_S = 1.0


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ridge.config import EngineConfig
    from ridge.engine.engine import LLMEngine
    from ridge.server.app import build_app
    from ridge.server.serving import ServerConfig

    api_key = args.api_key if args.api_key is not None else os.environ.get("RIDGE_API_KEY") or None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("ridge serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or [args.model]),
        model_root=args.model,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        tool_call_parser=args.tool_call_parser,
    )
    engine_config = EngineConfig.from_kwargs(args.model, **engine_options(args))  # bad flags fail before binding
    sock = bind_socket(args.host, args.port)
    engine = async_engine = None
    try:
        engine = LLMEngine(engine_config)
        engine.resolve_roofline()  # for /metrics: probed (or read from cache) now, not at a scrape
        app = build_app(engine, config)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        info = engine.stats().info
        print(
            f"ridge serve: {config.served_model_names[0]} on http://{shown}:{port} "
            f"({info['dtype']}, {info['device']}, {info['num_kv_blocks']} KV blocks, {info['scheduler']} batching, "
            f"max_model_len {info['max_model_len']})"
            f"{_kv_role_note(engine.kv_info())}{' (API key required)' if api_key else ''}",
            file=sys.stderr,
            flush=True,
        )
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level=args.log_level,
                access_log=not args.disable_access_log,
                timeout_graceful_shutdown=args.graceful_shutdown_timeout,
                timeout_keep_alive=30,
            )
        )
        async_engine = app.state.ridge.engine

        def exit_on_fatal(exc: BaseException) -> None:
            """A rank died or hung: the open streams have their error event; new requests get
            503 until uvicorn has shut down (a moment later), then the process exits with 1."""
            print(f"ridge serve: the engine failed ({exc}); shutting down", file=sys.stderr, flush=True)
            threading.Timer(FATAL_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True)).start()

        async_engine.on_fatal = exit_on_fatal
        server.run(sockets=[sock])
    finally:
        sock.close()
        if engine is not None:
            engine.shutdown()
    return 1 if async_engine is not None and async_engine.error is not None else 0
