"""``ridge router``: the front for disaggregated (``--prefill`` / ``--decode``) or replicated
(``--replica``) ``ridge serve`` instances, on uvicorn (see ``ridge/router/app.py``)."""

from __future__ import annotations

import argparse
import os
import sys

from ridge.server.listen import DEFAULT_HOST, bind_socket

DEFAULT_PORT = 8000


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "router",
        help="route requests over prefill/decode instances (disaggregated) or replicas",
        description="An OpenAI-compatible front: each request's prompt runs on a --prefill instance "
        '(ridge serve --kv-transfer-config \'{"kv_role": "kv_producer", ...}\'), its KV cache moves to a '
        "--decode instance (kv_consumer), whose tokens stream back; or each request goes to one --replica. "
        "Instances are chosen by prefix affinity, then load.",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL", help="prefill instances")
    p.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL", help="decode instances")
    p.add_argument("--replica", nargs="+", action="extend", default=[], metavar="URL", help="colocated instances")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $RIDGE_API_KEY)")
    p.add_argument(
        "--instance-api-key", default=None, help="the key the instances require (default: the client's header)"
    )
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="prefix match (0..1) above which a request goes where its prefix went",
    )
    p.add_argument(
        "--balance-threshold",
        type=float,
        default=8.0,
        help="how many more requests than the least loaded instance the prefix's instance may have",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from ridge.router.app import RouterConfig, build_router_app

    config = RouterConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        replica=tuple(args.replica),
        api_key=args.api_key if args.api_key is not None else os.environ.get("RIDGE_API_KEY") or None,
        instance_api_key=args.instance_api_key,
        health_interval=args.health_interval,
        cache_threshold=args.cache_threshold,
        balance_threshold=args.balance_threshold,
    )
    sock = bind_socket(args.host, args.port)
    try:
        host, port = sock.getsockname()[:2]
        mode = (
            f"{len(config.prefill)} prefill + {len(config.decode)} decode instances"
            if config.disaggregated
            else f"{len(config.replica)} replicas"
        )
        print(f"ridge router: {mode} on http://{host}:{port}", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(build_router_app(config), log_level=args.log_level, access_log=False))
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
