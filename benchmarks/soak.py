"""Soak: many streamed requests with random everything against one ``ridge serve``.

    .venv/bin/python benchmarks/soak.py --model ../shared/models/stories260K      # 500 requests

A real server (a subprocess on loopback) with a small KV pool, so that requests are preempted
and recomputed. Requests go to both endpoints with random prompts, lengths (``max_tokens`` 1 to
160), sampling (greedy, temperature, top-p/k, min-p, penalties, seeds), ``n`` up to 3, stop
strings and logprobs; some clients disconnect in the middle of their stream. Then every greedy
request that finished is sent again alone, and its text must be the same. It reports:

* requests completed (every choice ended with a finish reason, then ``[DONE]``);
* 5xx replies (must be 0), and lost requests (must be 0): neither completed, nor refused
  with a 4xx, nor disconnected by the client on purpose;
* KV blocks in use once the server is idle (must be 0), and the preemptions that happened;
* greedy requests whose text alone differs from their text under load (must be 0).

Writes ``benchmarks/soak.json`` (``--out``); exits 1 when a "must be 0" is not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ridge.bench.serve import ridge_server

STARTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park",
    "One day, a big red ball",
    "Tom was sad because",
    "The sun was shining and",
    "Mom said",
    "There was a tiny bird who",
]


@dataclass
class Outcome:
    index: int
    endpoint: str
    body: dict
    disconnect_after: int | None  # chunks to read before hanging up on purpose
    status: int | None = None
    done: bool = False  # [DONE] arrived
    finished_choices: int = 0
    texts: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    disconnected: bool = False

    @property
    def choices(self) -> int:
        return self.body.get("n", 1)

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and self.finished_choices == self.choices

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature") == 0 and self.choices == 1


def random_body(rng: random.Random, endpoint: str, model: str) -> dict:
    prompt = rng.choice(STARTS) + rng.choice(["", ",", " and then", " " + " ".join(rng.sample(STARTS, 2))])
    body: dict = {"model": model, "max_tokens": rng.randint(1, 160), "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if rng.random() < 0.4:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.2, 1.5), 2)
        for name, value in (
            ("top_p", round(rng.uniform(0.3, 1.0), 2)),
            ("top_k", rng.randint(1, 50)),
            ("min_p", round(rng.uniform(0.0, 0.2), 3)),
            ("presence_penalty", round(rng.uniform(-1, 1), 2)),
            ("frequency_penalty", round(rng.uniform(-1, 1), 2)),
            ("repetition_penalty", round(rng.uniform(0.8, 1.3), 2)),
            ("seed", rng.choice([-1, rng.randint(0, 2**64 - 1)])),
            ("n", rng.randint(1, 3)),
        ):
            if rng.random() < 0.35:
                body[name] = value
    if rng.random() < 0.2:
        body["stop"] = rng.sample(["\n", ".", " the", "!", "ball"], rng.randint(1, 2))
    if rng.random() < 0.2:
        if endpoint == "chat":
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        else:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return body


async def run_one(client: httpx.AsyncClient, out: Outcome) -> None:
    path = "/v1/chat/completions" if out.endpoint == "chat" else "/v1/completions"
    chunks = 0
    try:
        async with client.stream("POST", path, json=out.body) as res:
            out.status = res.status_code
            if res.status_code != 200:
                await res.aread()
                out.error = res.text[:300]
                return
            async for line in res.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"].get("message")
                    continue
                for choice in event.get("choices", []):
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content") or ""
                    out.texts[choice["index"]] = out.texts.get(choice["index"], "") + text
                    if choice.get("finish_reason"):
                        out.finished_choices += 1
                chunks += 1
                if out.disconnect_after is not None and chunks >= out.disconnect_after:
                    out.disconnected = True
                    return  # leaving the context closes the connection mid-stream
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def soak(url: str, outcomes: list[Outcome], concurrency: int) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def guarded(out: Outcome) -> None:
            async with gate:
                await run_one(client, out)

        await asyncio.gather(*(guarded(o) for o in outcomes))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``, in a /metrics text."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def wait_idle(url: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        busy = metric(text, "ridge_num_requests_running") + metric(text, "ridge_num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared/models/stories260K"))
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--disconnect-rate", type=float, default=0.15)
    p.add_argument("--num-kv-blocks", type=int, default=40, help="small: forces preemptions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).with_name("soak.json")))
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    name = "soak"
    outcomes = []
    for i in range(args.requests):
        endpoint = rng.choice(["completions", "chat"])
        disconnect = rng.randint(1, 12) if rng.random() < args.disconnect_rate else None
        outcomes.append(Outcome(i, endpoint, random_body(rng, endpoint, name), disconnect))

    flags = [
        "--served-model-name",
        name,
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--block-size",
        "16",
        "--max-num-seqs",
        "32",
        "--dtype",
        "float32",
    ]
    with ridge_server(args.model, flags) as url:
        start = time.monotonic()
        asyncio.run(soak(url, outcomes, args.concurrency))
        soak_s = time.monotonic() - start
        metrics = wait_idle(url)
        # Every greedy request that finished, again, alone: the same text.
        greedy = [o for o in outcomes if o.completed and o.greedy]
        mismatched = []
        for o in greedy:
            alone = Outcome(o.index, o.endpoint, o.body, None)
            asyncio.run(soak(url, [alone], 1))
            if alone.texts != o.texts:
                mismatched.append({"index": o.index, "under_load": o.texts, "alone": alone.texts})
        metrics = wait_idle(url)

    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
    refused = [o for o in outcomes if o.status is not None and 400 <= o.status < 500]
    lost = [o for o in outcomes if not (o.completed or o.disconnected or o in refused or o in server_errors)]
    report = {
        "model": args.model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "num_kv_blocks": args.num_kv_blocks,
        "seconds": round(soak_s, 1),
        "completed": sum(o.completed for o in outcomes),
        "disconnected_on_purpose": sum(o.disconnected for o in outcomes),
        "refused_4xx": len(refused),
        "server_errors_5xx": max(len(server_errors), int(metric(metrics, "ridge_http_errors_total", status="500"))),
        "lost": len(lost),
        "kv_blocks_used_at_end": int(metric(metrics, "ridge_kv_cache_blocks", state="used")),
        "preemptions": int(metric(metrics, "ridge_num_preemptions_total")),
        "greedy_checked_alone": len(greedy),
        "greedy_mismatched": len(mismatched),
        "examples": {
            "lost": [asdict(o) for o in lost[:3]],
            "refused": [asdict(o) for o in refused[:3]],
            "mismatched": mismatched[:3],
        },
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    keys = (
        "requests",
        "completed",
        "disconnected_on_purpose",
        "refused_4xx",
        "server_errors_5xx",
        "lost",
        "kv_blocks_used_at_end",
        "preemptions",
        "greedy_checked_alone",
        "greedy_mismatched",
        "seconds",
    )
    for key in keys:
        print(f"{key:>24}  {report[key]}")
    must_be_zero = ("server_errors_5xx", "lost", "kv_blocks_used_at_end", "greedy_mismatched")
    return 1 if any(report[key] for key in must_be_zero) else 0


if __name__ == "__main__":
    sys.exit(main())
