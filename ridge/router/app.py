"""``ridge router``: one OpenAI-compatible front for several ``ridge serve`` instances.

Two modes:

* **Disaggregated** (``--prefill URL ... --decode URL ...``): each request's prompt goes to a
  prefill instance (a ``kv_producer``) as a one-token, non-streamed request marked
  ``kv_transfer_params: {"do_remote_decode": true}``; its answer says where the prompt's KV
  cache waits. The request then goes, unchanged but for that answer, to a decode instance (a
  ``kv_consumer``), which pulls the blocks it lacks and generates; its response (JSON or
  server-sent events) streams back to the client byte for byte. Before a prefill and a decode
  instance first share a request, the router pairs them (``POST /kv/connect`` to both, each
  with the other's ``/kv/info``); a pairing that fails answers 502 with the instance's reason.
* **Replicas** (``--replica URL ...``): colocated instances (data parallelism); each request
  goes to one of them.

Either way the instance is chosen by prefix affinity, then load (``router/policy.py``). A
health loop polls each instance (``/health``, ``/metrics`` for its load and transfers,
``/kv/info``) every ``health_interval`` seconds; an instance that refuses a check, or breaks
off a request, leaves the rotation until it answers again (one that answers only slowly, after
``UNRESPONSIVE_S``). A request whose instance dies ends with a clear
error (502, or for a stream an error event and ``[DONE]``); other requests go on. A prefill
instance that cannot be reached before it answered is retried on another.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics`` (per instance: health, requests, errors, in flight, and the KV transfers' bytes,
blocks and seconds the instances report; the prefill leg's duration).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ridge import __version__
from ridge.router.policy import Instance, PrefixAffinity

logger = logging.getLogger("ridge.router")

DONE = b"data: [DONE]\n\n"
# What a prefill instance's answer takes at most (a long prompt on a slow machine: minutes).
DEFAULT_REQUEST_TIMEOUT_S = 600.0
CHECK_TIMEOUT_S = 2.0  # /health answers at once, even while the engine runs a long step
STATE_TIMEOUT_S = 2.0  # /metrics and /kv/info wait for the engine between two steps
UNRESPONSIVE_S = 30.0  # an instance whose /health times out this long leaves the rotation
# The instances' counters the router re-exports per instance (ridge serve's /metrics names).
KV_COUNTERS = {
    "ridge_kv_transfer_transfers_total": "transfers",
    "ridge_kv_transfer_blocks_total": "blocks",
    "ridge_kv_transfer_bytes_total": "bytes",
    "ridge_kv_transfer_blocks_skipped_total": "blocks_skipped",
    "ridge_kv_transfer_seconds_total": "seconds",
    "ridge_kv_transfer_failures_total": "failures",
}


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    replica: tuple[str, ...] = ()
    api_key: str | None = None  # what clients must send (None: nothing)
    instance_api_key: str | None = None  # what the router sends the instances (None: the client's header)
    health_interval: float = 1.0
    cache_threshold: float = 0.5
    balance_threshold: float = 8.0
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.replica and (self.prefill or self.decode):
            raise ValueError("give --prefill and --decode instances (disaggregated), or --replica instances, not both")
        if not self.replica and not (self.prefill and self.decode):
            raise ValueError("the router needs --prefill and --decode instances, or --replica instances")
        for url in self.prefill + self.decode + self.replica:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"an instance is an http(s) URL, got {url!r}")
        every = self.prefill + self.decode + self.replica
        if len(set(every)) != len(every):
            raise ValueError("an instance URL is given twice")
        if not self.health_interval > 0:
            raise ValueError("health_interval must be > 0 seconds")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)


class RouterError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, self.code), status_code=self.status)


def error_body(message: str, status: int = 502, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class Router:
    """The instances, the policy, the pairs, the health loop; see the module docstring."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.instances = (
            [Instance(u.rstrip("/"), "prefill") for u in config.prefill]
            + [Instance(u.rstrip("/"), "decode") for u in config.decode]
            + [Instance(u.rstrip("/"), "replica") for u in config.replica]
        )
        self.policy = PrefixAffinity(config.cache_threshold, config.balance_threshold)
        self.client: httpx.AsyncClient | None = None
        self._paired: set[tuple[str, str]] = set()  # (producer engine id, consumer engine id)
        self._pair_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._health_task: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.prefill_seconds = Histogram(
            "ridge_router_prefill_seconds",
            "Seconds of a request's prefill leg (prompt on the prefill instance, until it handed over).",
            ["instance"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.registry.register(_InstanceCollector(self))

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout, connect=5.0), limits=limits)
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.client is not None:
            await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                logger.exception("health check failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(inst) for inst in self.instances))

    async def check(self, inst: Instance) -> None:
        """Health (``/health``: in or out of rotation), then, as far as the instance answers
        in time, its load (``/metrics``) and KV identity (``/kv/info``: a prefill or decode
        instance needs it once to be paired). A dead instance refuses or drops the connection
        at once and leaves the rotation; one that only answers slowly (a long step) stays in
        it up to ``UNRESPONSIVE_S``."""
        try:
            health = await self.client.get(f"{inst.url}/health", timeout=CHECK_TIMEOUT_S)
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}")
        except httpx.TimeoutException as exc:
            if not inst.healthy or time.monotonic() - inst.last_seen > UNRESPONSIVE_S:
                self._down(inst, f"no answer for {time.monotonic() - inst.last_seen:.0f} s ({type(exc).__name__})")
            return
        except Exception as exc:
            self._down(inst, f"{type(exc).__name__}: {exc}")
            return
        inst.last_seen = time.monotonic()
        try:
            metrics = await self.client.get(f"{inst.url}/metrics", timeout=STATE_TIMEOUT_S)
            self._read_metrics(inst, metrics.text)
        except Exception:  # busy between two steps: the last load read stands
            pass
        if inst.role != "replica":
            try:
                url, headers = f"{inst.url}/kv/info", self._headers(None)
                info = await self.client.get(url, headers=headers, timeout=STATE_TIMEOUT_S)
                if info.status_code != 200:
                    raise RuntimeError(f"/kv/info answered {info.status_code} (no --kv-transfer-config?)")
                self._set_kv_info(inst, info.json())
            except Exception as exc:
                if inst.kv_info is None:  # never identified: it cannot be paired yet
                    self._down(inst, f"{type(exc).__name__}: {exc}")
                    return
        if not inst.healthy:
            logger.info("instance %s (%s) is up", inst.url, inst.role)
        inst.healthy = True

    def _set_kv_info(self, inst: Instance, info: dict) -> None:
        old = inst.engine_id
        inst.kv_info = info
        if old is not None and old != inst.engine_id:  # restarted: a new engine, an empty cache
            self.policy.forget(inst)
        if inst.role == "decode":  # pairs the consumer no longer holds must be made again
            peers = set(info.get("peers", ()))
            self._paired = {p for p in self._paired if p[1] != inst.engine_id or p[0] in peers}

    def _read_metrics(self, inst: Instance, text: str) -> None:
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        inst.waiting = values.get("ridge_num_requests_waiting", 0.0)
        inst.running = values.get("ridge_num_requests_running", 0.0)
        inst.kv_usage = values.get("ridge_kv_cache_usage_ratio", 0.0)
        inst.kv_metrics = {short: values[name] for name, short in KV_COUNTERS.items() if name in values}

    def _down(self, inst: Instance, why: str) -> None:
        if inst.healthy:
            logger.warning("instance %s (%s) is out of rotation: %s", inst.url, inst.role, why)
        inst.healthy = False
        inst.last_error = why

    # -- choosing ----------------------------------------------------------------------------
    def pick(self, role: str, text: str, exclude: set[str] = frozenset()) -> Instance:
        candidates = [i for i in self.instances if i.role == role and i.healthy and i.url not in exclude]
        if not candidates:
            raise RouterError(503, f"no healthy {role} instance", "no_instance")
        return self.policy.choose(candidates, text)

    def _headers(self, raw: Request | None) -> dict[str, str]:
        if self.config.instance_api_key:
            return {"Authorization": f"Bearer {self.config.instance_api_key}"}
        given = raw.headers.get("authorization") if raw is not None else None
        return {"Authorization": given} if given and self.config.api_key is None else {}

    # -- pairing -----------------------------------------------------------------------------
    async def ensure_paired(self, prefill: Instance, decode: Instance) -> None:
        """Pair a producer and a consumer (once); RouterError(502) with the instance's reason."""
        for inst in (prefill, decode):
            if inst.kv_info is None:
                await self.check(inst)
                if inst.kv_info is None:
                    raise RouterError(502, f"the {inst.role} instance {inst.url} is unreachable ({inst.last_error})")
        key = (prefill.engine_id, decode.engine_id)
        if key in self._paired:
            return
        lock = self._pair_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._paired:
                return
            answers = await asyncio.gather(
                self._connect(prefill, decode.kv_info), self._connect(decode, prefill.kv_info), return_exceptions=True
            )
            problems = [a for a in answers if isinstance(a, BaseException)]
            if problems:
                # the side that refused says why; the other only that its peer did not join
                first = min(problems, key=lambda e: "did not join" in str(e))
                raise RouterError(502, f"cannot pair {prefill.url} with {decode.url}: {first}", "kv_pairing_failed")
            self._paired.add(key)
            logger.info("paired prefill %s with decode %s", prefill.url, decode.url)

    async def _connect(self, inst: Instance, peer: dict) -> None:
        try:
            resp = await self.client.post(f"{inst.url}/kv/connect", json=peer, headers=self._headers(None), timeout=60)
        except httpx.TransportError as exc:
            self._down(inst, f"{type(exc).__name__}: {exc}")
            raise RuntimeError(f"{inst.url} is unreachable ({type(exc).__name__})") from None
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except Exception:
                message = resp.text
            raise RuntimeError(f"{inst.url} says: {message}")

    # -- requests ----------------------------------------------------------------------------
    async def handle(self, path: str, raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse(error_body(f"Malformed JSON in the request body: {exc}", 400, "invalid_json"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body must be a JSON object", 400), 400)
        text = prompt_text(body)
        headers = self._headers(raw)
        try:
            if not self.config.disaggregated:
                return await self._to_replica(path, body, headers, text)
            return await self._disaggregated(path, body, headers, text)
        except RouterError as exc:
            return exc.response()

    async def _to_replica(self, path: str, body: dict, headers: dict, text: str) -> Response:
        tried: set[str] = set()
        while True:
            inst = self.pick("replica", text, tried)
            try:
                return await self._forward(inst, path, body, headers)
            except _Unreachable:
                tried.add(inst.url)  # nothing reached it: another replica may take the request

    async def _disaggregated(self, path: str, body: dict, headers: dict, text: str) -> Response:
        if _needs_every_prompt_logit(body):  # the decode instance computes such a prompt itself
            return await self._forward(self.pick("decode", text), path, body, headers)
        tried: set[str] = set()
        while True:
            try:
                prefill = self.pick("prefill", text, tried)
            except RouterError:
                if not tried:
                    raise
                failed = ", ".join(sorted(tried))
                raise RouterError(502, f"the prefill instance {failed} failed, and no other is healthy") from None
            decode = self.pick("decode", text)
            try:
                await self.ensure_paired(prefill, decode)
            except RouterError:
                # a prefill instance that died before the health loop saw it fails its pairing
                # (the first request a new pair carries): it took nothing, so another may
                if prefill.healthy:
                    raise
                tried.add(prefill.url)
                continue
            start = time.monotonic()
            prefill.in_flight += 1
            prefill.requests += 1
            decode.in_flight += 1  # spoken for: later picks see it
            try:
                answer = await self.client.post(f"{prefill.url}{path}", json=prefill_body(path, body), headers=headers)
            except httpx.TransportError as exc:
                self._failed(prefill, exc)
                tried.add(prefill.url)
                continue
            finally:
                prefill.in_flight -= 1
                decode.in_flight -= 1
            self.prefill_seconds.labels(prefill.url).observe(time.monotonic() - start)
            if answer.status_code != 200:  # the client's own error (a bad value, too long): as it is
                return Response(answer.content, answer.status_code, media_type="application/json")
            handover = answer.json().get("kv_transfer_params")
            if not handover:
                raise RouterError(502, f"the prefill instance {prefill.url} did not hand the request over")
            return await self._forward(decode, path, {**body, "kv_transfer_params": handover}, headers)

    def _failed(self, inst: Instance, exc: BaseException) -> None:
        inst.errors += 1
        self._down(inst, f"{type(exc).__name__}: {exc}")

    async def _forward(self, inst: Instance, path: str, body: dict, headers: dict) -> Response:
        """``body`` to ``inst``; its answer streamed back unchanged (an error if it breaks off)."""
        request = self.client.build_request("POST", f"{inst.url}{path}", json=body, headers=headers)
        inst.in_flight += 1
        inst.requests += 1
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            inst.in_flight -= 1
            self._failed(inst, exc)
            if inst.role == "replica":
                raise _Unreachable() from None
            raise RouterError(
                502, f"the {inst.role} instance {inst.url} is unreachable ({type(exc).__name__})"
            ) from None
        streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not streaming:
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:
                self._failed(inst, exc)
                why = f"the {inst.role} instance {inst.url} failed mid-answer ({type(exc).__name__})"
                raise RouterError(502, why) from None
            finally:
                await resp.aclose()
                inst.in_flight -= 1
            return Response(content, resp.status_code, media_type=resp.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.TransportError as exc:
                self._failed(inst, exc)
                message = f"the {inst.role} instance {inst.url} failed mid-stream ({type(exc).__name__})"
                yield b"\n\ndata: " + json.dumps(error_body(message)).encode() + b"\n\n" + DONE
            finally:
                await resp.aclose()
                inst.in_flight -= 1

        return StreamingResponse(
            relay(),
            status_code=resp.status_code,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


class _Unreachable(Exception):
    pass


def prompt_text(body: dict) -> str:
    """The text a request's prefix affinity is computed on (its prompt, or its messages)."""
    if "messages" in body:
        parts = []
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else m
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role') if isinstance(m, dict) else ''}:{content}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt)


def _needs_every_prompt_logit(body: dict) -> bool:
    return bool(body.get("echo")) and body.get("logprobs") is not None


def prefill_body(path: str, body: dict) -> dict:
    """The prefill leg: the same prompt and samples, each to its first token (and its logprobs,
    when asked), not streamed; the decode instance goes on from there."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "echo", "best_of", "max_tokens")}
    out.update(stream=False, min_tokens=min(int(body.get("min_tokens") or 0), 1))
    out["kv_transfer_params"] = {"do_remote_decode": True}
    out["max_completion_tokens" if path.endswith("chat/completions") else "max_tokens"] = 1
    return out


class _InstanceCollector(Collector):
    """Per instance, read at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        labels = ["instance", "role"]
        healthy = GaugeMetricFamily(
            "ridge_router_instance_healthy", "1 while the instance is in rotation.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "ridge_router_in_flight", "Requests the router has in flight there.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "ridge_router_instance_waiting", "Sequences the instance reports waiting.", labels=labels
        )
        requests = CounterMetricFamily("ridge_router_requests", "Requests the router sent the instance.", labels=labels)
        errors = CounterMetricFamily(
            "ridge_router_errors", "Requests the instance failed (unreachable, broke off).", labels=labels
        )
        kv = {
            short: CounterMetricFamily(
                f"ridge_router_kv_{short}",
                f"KV transfer {short} the instance reports (its ridge_kv_transfer_*).",
                labels=labels,
            )
            for short in KV_COUNTERS.values()
        }
        for inst in self.router.instances:
            values = [inst.url, inst.role]
            healthy.add_metric(values, 1.0 if inst.healthy else 0.0)
            in_flight.add_metric(values, inst.in_flight)
            waiting.add_metric(values, inst.waiting)
            requests.add_metric(values, inst.requests)
            errors.add_metric(values, inst.errors)
            for short, value in inst.kv_metrics.items():
                kv[short].add_metric(values, value)
        yield from (healthy, in_flight, waiting, requests, errors, *kv.values())


def build_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="ridge router", version=__version__, lifespan=lifespan)
    app.state.router = router
    expected = f"Bearer {config.api_key}" if config.api_key else None

    def authorized(raw: Request) -> bool:
        given = raw.headers.get("authorization", "")
        return expected is None or hmac.compare_digest(given.encode(), expected.encode())

    def unauthorized() -> JSONResponse:
        return JSONResponse(error_body("Incorrect or missing API key.", 401, "invalid_api_key"), 401)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await router.handle("/v1/completions", raw) if authorized(raw) else unauthorized()

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await router.handle("/v1/chat/completions", raw) if authorized(raw) else unauthorized()

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        if not authorized(raw):
            return unauthorized()
        for inst in router.instances:
            if inst.healthy and inst.role != "prefill":
                try:
                    resp = await router.client.get(f"{inst.url}/v1/models", headers=router._headers(raw))
                    return Response(resp.content, resp.status_code, media_type="application/json")
                except httpx.TransportError as exc:
                    router._failed(inst, exc)
        return JSONResponse(error_body("no healthy instance", 503, "no_instance"), 503)

    @app.get("/health")
    async def health() -> Response:
        roles = {"replica"} if not config.disaggregated else {"prefill", "decode"}
        missing = [r for r in sorted(roles) if not any(i.healthy and i.role == r for i in router.instances)]
        if missing:
            return JSONResponse(error_body(f"no healthy {' or '.join(missing)} instance", 503), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app
