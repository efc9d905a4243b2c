"""The OpenAI-compatible server (``ridge serve``).

    protocol.py      pydantic models of the OpenAI requests, responses and error object
    async_engine.py  the engine loop thread and its asyncio bridge (abort on disconnect)
    serving.py       completions and chat: requests -> engine -> responses / SSE
    metrics.py       Prometheus metrics on a per-app registry
    app.py           the FastAPI app factory: routes, errors, API key, body-size limit
    cli.py           ``ridge serve`` on uvicorn

Use ``ridge.server.app.build_app(engine, ServerConfig(...))`` to embed the server; this
package imports nothing heavy itself, so the CLI starts fast.
"""
