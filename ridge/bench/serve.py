"""``ridge bench serve``: a load generator for any OpenAI-compatible server.

Sends N streaming requests (Poisson arrivals at ``--request-rate``, or all at once) to
``/v1/completions`` or ``/v1/chat/completions`` and measures, per request, what users feel
(the definitions of vLLM's and SGLang's serving benchmarks):

* TTFT, time to first token: request sent -> first chunk with a choice (a chat stream's
  opening role-only chunk excepted);
* TPOT, time per output token: (end-to-end - TTFT) / (output tokens - 1);
* ITL, inter-token latency: the gaps between successive chunks (a chunk usually carries one
  token; its text may be empty, e.g. half a UTF-8 character);
* E2EL, end-to-end latency: request sent -> last chunk;

and over the run: request and output-token throughput, and goodput (requests per second that
meet ``--slo-ttft-ms`` and ``--slo-tpot-ms``). Token counts come from the server's ``usage``
(``stream_options.include_usage``) when it sends one, else from the chunks.

Prompts: with a tokenizer (``--tokenizer``, or the one of ``--model``) a prompt is
``input_len`` random ordinary token ids (sent as ids to completions, as their text to chat);
without one it is ``input_len`` words. ``--dataset FILE.jsonl`` instead takes one request per
line: ``{"prompt": str | [ids], "max_tokens": int}``. Output lengths are made exact with
``ignore_eos`` (a vLLM extension; ``--no-ignore-eos`` for servers that refuse it).

``--model`` starts ``ridge serve`` in a subprocess on a free loopback port (with the engine
flags given here) and stops it afterwards; ``--base-url`` targets a running server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from ridge.engine.args import add_engine_args
from ridge.stats import percentile

PERCENTILES = (50, 90, 99)
# Words for text prompts when no tokenizer is known (roughly one token each in most vocabularies).
_WORDS = (
    "the cat sat on a mat and then it ran to see the big red ball in the park with a little girl "
    "who was happy to play all day long under the warm sun"
).split()


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthSpec:
    """A fixed length ``N`` or a uniform range ``LO:HI`` (inclusive)."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        try:
            lo, _, hi = str(text).partition(":")
            spec = cls(int(lo), int(hi) if hi else int(lo))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
        if spec.lo < 1 or spec.hi < spec.lo:
            raise argparse.ArgumentTypeError(f"lengths must satisfy 1 <= LO <= HI, got {text!r}")
        return spec

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    prompt_len: int | None = None  # known when built from token ids


def ordinary_token_ids(tokenizer) -> list[int]:
    """Ids whose text is printable and non-blank and that are not special (safe prompt filler)."""
    ids = []
    for i in range(min(tokenizer.vocab_size, 50_000)):
        piece = tokenizer.piece(i)
        if not piece.special and piece.text.strip() and piece.text.isprintable() and "\ufffd" not in piece.text:
            ids.append(i)
    if not ids:
        raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
    return ids


def build_workload(
    num_prompts: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    seed: int,
    tokenizer=None,
    dataset: str | None = None,
) -> list[BenchRequest]:
    """The requests, in send order; the same arguments always give the same workload."""
    if dataset:
        return load_dataset(dataset, num_prompts)
    rng = random.Random(seed)
    vocab = ordinary_token_ids(tokenizer) if tokenizer is not None else None
    out = []
    for _ in range(num_prompts):
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        if vocab is not None:
            out.append(BenchRequest([rng.choice(vocab) for _ in range(n_in)], n_out, n_in))
        else:
            out.append(BenchRequest(" ".join(rng.choice(_WORDS) for _ in range(n_in)), n_out))
    return out


def load_dataset(path: str, limit: int | None = None) -> list[BenchRequest]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, max_tokens = row["prompt"], int(row.get("max_tokens", row.get("output_len", 0)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f'{path}:{lineno}: expected {{"prompt": ..., "max_tokens": N}}: {exc}') from None
            if max_tokens < 1 or not isinstance(prompt, (str, list)) or not prompt:
                raise ValueError(f"{path}:{lineno}: needs a non-empty prompt and max_tokens >= 1")
            out.append(BenchRequest(prompt, max_tokens, len(prompt) if isinstance(prompt, list) else None))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start): all 0 for an infinite rate, else a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# -- one request -------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds since the run began
    text_len: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


async def send_request(
    client: httpx.AsyncClient, endpoint: str, model: str, req: BenchRequest, ignore_eos: bool, tokenizer, t0: float
) -> RequestResult:
    """One streaming request; never raises for a server or network failure (``ok`` False)."""
    res = RequestResult(prompt_len=req.prompt_len or 0)
    if endpoint == "chat":
        content = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(req.prompt)
        path, payload = "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}
    else:
        path, payload = "/v1/completions", {"prompt": req.prompt}
    payload.update(
        model=model, max_tokens=req.max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True}
    )
    if ignore_eos:
        payload["ignore_eos"] = True
    sent = time.perf_counter()
    res.start = sent - t0
    last = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    return res
                if chunk.get("usage"):
                    res.prompt_len = chunk["usage"].get("prompt_tokens", res.prompt_len)
                    res.output_len = chunk["usage"].get("completion_tokens", 0)
                for choice in chunk.get("choices") or []:
                    if endpoint == "chat":
                        delta = choice.get("delta") or {}
                        if "role" in delta and not delta.get("content") and not choice.get("finish_reason"):
                            continue  # the opening chunk: no token yet
                        text = delta.get("content") or ""
                    else:
                        text = choice.get("text") or ""
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - sent
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    res.text_len += len(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if last is None:
        res.error = "no token came back"
        return res
    res.e2el = last - sent
    res.output_len = res.output_len or chunks
    res.ok = True
    return res


# -- the run -----------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str | None = None
    timeout_s: float = 600.0


async def run_benchmark(config: BenchConfig, workload: Sequence[BenchRequest], tokenizer=None) -> dict:
    """Send ``workload`` to ``config.base_url`` and return the summary (see ``summarize``)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"), timeout=timeout, limits=limits, headers=headers
    ) as client:
        model = config.model or await _first_model(client)
        offsets = arrival_offsets(len(workload), config.request_rate, config.seed)
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        t0 = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate or contextlib.nullcontext():
                return await send_request(client, config.endpoint, model, req, config.ignore_eos, tokenizer, t0)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(workload, offsets)))
        duration = time.perf_counter() - t0
    summary = summarize(results, duration, config)
    summary["model"] = model
    return summary


async def _first_model(client: httpx.AsyncClient) -> str:
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"cannot list the models at {client.base_url}/v1/models ({exc}); pass --served-model-name"
        ) from None


def _stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, median, p90, p99 (and std) of ``values`` in ms (linear interpolation between ranks)."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None}
    xs = [v * scale for v in values]  # percentile sorts
    mean = sum(xs) / len(xs)
    return {
        "mean": mean,
        "median": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)),
    }


def summarize(results: Sequence[RequestResult], duration: float, config: BenchConfig) -> dict:
    """The run's numbers: counts, throughputs, goodput, latency stats (ms), per-request rows."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    slo = config.slo_ttft_ms is not None or config.slo_tpot_ms is not None
    good = None
    if slo:
        good = sum(
            1
            for r in ok
            if (config.slo_ttft_ms is None or r.ttft * 1000 <= config.slo_ttft_ms)
            and (config.slo_tpot_ms is None or r.tpot is None or r.tpot * 1000 <= config.slo_tpot_ms)
        )
    cfg = asdict(config)
    cfg.pop("api_key")
    cfg["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return {
        "config": cfg,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "goodput": None if good is None else good / duration,
        "good_requests": good,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2el for r in ok]),
        "requests": [
            {
                "start_s": r.start,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "ttft_ms": r.ttft * 1000,
                "e2el_ms": r.e2el * 1000,
                "tpot_ms": None if r.tpot is None else r.tpot * 1000,
                "ok": r.ok,
            }
            for r in results
        ],
    }


def print_summary(summary: dict, file=None) -> None:
    """A short readable table (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout)
    cfg = summary["config"]
    table = Table(
        title=f"ridge bench serve: {summary.get('model')} at {cfg['base_url']} ({cfg['endpoint']})",
        show_header=True,
        header_style="bold",
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests ok / failed", f"{summary['completed']} / {summary['failed']}")
    table.add_row("request rate", f"{cfg['request_rate']} req/s, max concurrency {cfg['max_concurrency'] or '-'}")
    table.add_row("duration", f"{summary['duration_s']:.2f} s")
    table.add_row("input / output tokens", f"{summary['total_input_tokens']} / {summary['total_output_tokens']}")
    table.add_row("request throughput", f"{summary['request_throughput']:.2f} req/s")
    table.add_row("output token throughput", f"{summary['output_throughput']:.1f} tok/s")
    table.add_row("total token throughput", f"{summary['total_token_throughput']:.1f} tok/s")
    if summary["goodput"] is not None:
        table.add_row("goodput", f"{summary['goodput']:.2f} req/s ({summary['good_requests']} within the SLOs)")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        s = summary[key]
        if s["median"] is None:
            table.add_row(f"{label} (ms)", "-")
        else:
            table.add_row(
                f"{label} (ms) mean / median / p90 / p99",
                f"{s['mean']:.1f} / {s['median']:.1f} / {s['p90']:.1f} / {s['p99']:.1f}",
            )
    console.print(table)
    for err in summary["errors"]:
        console.print(f"[red]error:[/red] {err}")


# -- starting a ridge server -------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ridge_server(
    model: str, server_args: Sequence[str] = (), timeout_s: float = 300.0, host: str = "127.0.0.1"
) -> Iterator[str]:
    """``ridge serve --model MODEL`` in a subprocess on a free port; yields its base URL.

    Raises ValueError (with the end of the server's log) if it exits or is not healthy within
    ``timeout_s``. Stopped with SIGINT (as Ctrl-C), then killed if it lingers.
    """
    port = free_port(host)
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty server never blocks
    cmd = [
        sys.executable,
        "-m",
        "ridge.cli",
        "serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--disable-access-log",
        *server_args,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, proc, timeout_s, lambda: _tail(log))
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(2)  # SIGINT: a clean shutdown
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log=lambda: "") -> None:
    """Until ``GET url/health`` answers 200; ValueError (with ``log()``, the end of the
    server's output) when ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ValueError(f"the server at {url} exited with code {proc.returncode}:\n{log()}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"the server at {url} was not healthy within {timeout_s:.0f} s:\n{log()}")
        time.sleep(0.2)


def _tail(log, lines: int = 20) -> str:
    log.flush()
    log.seek(0)
    return "".join(log.readlines()[-lines:])


def server_flags(args: argparse.Namespace, parser_defaults: dict[str, Any]) -> list[str]:
    """The engine flags given on this command line (those that differ from their defaults),
    as ``ridge serve`` arguments."""
    from ridge.engine.args import engine_options

    flags = []
    for name, value in sorted(engine_options(args).items()):
        if value == parser_defaults.get(name):
            continue
        if name == "enable_prefix_caching":
            flags.append("--no-prefix-caching")
        elif name == "enable_chunked_prefill":
            flags.append("--no-chunked-prefill")
        else:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def load_bench_tokenizer(name: str | None):
    """A ridge tokenizer for building prompts: a directory, ``bytes`` / ``random:...`` (bytes), or None."""
    if not name:
        return None
    from ridge.engine.tokenizer import ByteTokenizer, load_tokenizer

    if name == "bytes" or name.startswith("random:"):
        return ByteTokenizer()
    return load_tokenizer(name)


# -- the command -------------------------------------------------------------------------------


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)",
        description=__doc__.split("\n\n")[0],
    )
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--served-model-name", default=None, help="the model name to request (default: the first of /v1/models)"
    )
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--input-len", type=LengthSpec.parse, default=LengthSpec(32, 32), help="N or LO:HI (tokens)")
    w.add_argument("--output-len", type=LengthSpec.parse, default=LengthSpec(64, 64), help="N or LO:HI (tokens)")
    w.add_argument("--dataset", default=None, help='JSONL, one {"prompt": ..., "max_tokens": N} per line')
    w.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: all at once)")
    w.add_argument("--max-concurrency", type=int, default=None)
    w.add_argument("--bench-seed", type=int, default=0, help="seed of the workload and the arrivals")
    w.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (outputs may end early)",
    )
    w.add_argument("--slo-ttft-ms", type=float, default=None)
    w.add_argument("--slo-tpot-ms", type=float, default=None)
    w.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the summary as JSON (and nothing else)")
    out.add_argument("--per-request", action="store_true", help="keep the per-request rows in the JSON")
    out.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for --model's server")
    # The engine flags of `ridge serve`, for --model; --model itself is optional here.
    add_engine_args(p, default_model="")
    p.set_defaults(func=run_bench_serve, engine_flag_defaults={a.dest: a.default for a in p._actions})


def run_bench_serve(args: argparse.Namespace) -> int:
    if bool(args.base_url) == bool(args.model):
        raise ValueError("give exactly one of --base-url (a running server) and --model (start one)")
    for name in ("num_prompts", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    tokenizer = load_bench_tokenizer(args.tokenizer or (args.model or None))
    workload = build_workload(
        args.num_prompts, args.input_len, args.output_len, args.bench_seed, tokenizer, args.dataset
    )
    config = BenchConfig(
        base_url=args.base_url or "",
        model=args.served_model_name,
        endpoint=args.endpoint,
        num_prompts=len(workload),
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        seed=args.bench_seed,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        api_key=args.api_key,
        timeout_s=args.request_timeout,
    )
    if args.model:
        with ridge_server(args.model, server_flags(args, args.engine_flag_defaults), args.server_timeout) as url:
            config.base_url = url
            summary = asyncio.run(run_benchmark(config, workload, tokenizer))
    else:
        summary = asyncio.run(run_benchmark(config, workload, tokenizer))
    if not args.per_request:
        summary.pop("requests")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if summary["completed"] else 1
