"""This machine's link between tensor-parallel ranks, measured: two processes (one thread and
one core each, as ``--tensor-parallel-size 2`` runs them) all-reduce the way the engine's
ranks do here: in shared memory (``distributed/shm.py``), or over gloo on loopback with
``RIDGE_TP_SHM=0``.

    latency    the median all-reduce of one hidden state (2,048 floats: what a batch-1 decode
               reduces per layer), less what its bytes take at the bandwidth below
    bandwidth  per rank: a ring all-reduce of 8 MiB sends 2 (N-1)/N of it, over the median time

Cached beside the hardware probe (``$RIDGE_CACHE_DIR``), keyed by the machine's fingerprint.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch

from ridge.config import default_cache_dir
from ridge.roofline.ops import Link

CACHE_FILE_NAME = "link-{transport}.json"
SMALL, LARGE = 2048, 2 * 2**20  # float32 elements
REPEATS = {SMALL: 400, LARGE: 20}


def _transport() -> str:
    from ridge.distributed import launch

    return "shm" if launch.shm_enabled() else "gloo"


def _measure(rank: int, port: int, out, transport: str = "gloo") -> None:
    import os

    import torch.distributed as dist

    from ridge.distributed import launch
    from ridge.distributed.parallel import TensorParallel

    cores = launch.usable_cores()
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=dt.timedelta(seconds=60))
    tp = TensorParallel(rank, 2, launch._gloo(store, rank, 2, dt.timedelta(seconds=60)))
    if transport == "shm":
        if rank == 0:
            tp.shm = launch.shm_group(f"ridge-probe-{port}", rank, 2, lambda: True, create=True)
        tp.group.barrier().wait()  # the file exists before rank 1 maps it
        if rank == 1:
            tp.shm = launch.shm_group(f"ridge-probe-{port}", rank, 2, lambda: True)
    result = {}
    for n, repeats in REPEATS.items():
        x = torch.ones(n)
        for _ in range(10):
            tp.all_reduce(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            tp.all_reduce(x)
            times.append(time.perf_counter() - start)
        result[n] = statistics.median(times)
    tp.group.barrier().wait()
    if tp.shm is not None and rank == 0:
        tp.shm.unlink()
    if out is not None:
        out.put(result)


def probe_link(transport: str | None = None) -> Link:
    """Measure now (a few seconds); ``transport``: "shm" or "gloo" (default: what tensor
    parallelism uses here)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    transport = transport or _transport()
    peer = context.Process(target=_measure, args=(1, port, None, transport), daemon=True)
    peer.start()
    _measure(0, port, queue, transport)
    peer.join(timeout=60)
    times = queue.get()
    sent = LARGE * 4 * 2 * (2 - 1) / 2  # a ring all-reduce over 2 ranks sends half of it, twice
    bandwidth = sent / times[LARGE]
    latency = max(times[SMALL] - SMALL * 4 / bandwidth, 0.0)
    when = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    name = "shared memory (this machine)" if transport == "shm" else "gloo over loopback (this machine)"
    return Link(name, bandwidth, latency, f"measured {when}: medians of {REPEATS}")


def local_link(cache_dir: Path | None = None, reprobe: bool = False, transport: str | None = None) -> Link:
    """This machine's link: from the cache when it is there, else probed and cached.
    ``transport``: "gloo" (between instances: KV transfers), "shm", or None (what tensor
    parallelism uses here)."""
    from ridge.roofline.probe import machine_fingerprint

    transport = transport or _transport()
    path = (cache_dir or default_cache_dir()) / CACHE_FILE_NAME.format(transport=transport)
    fingerprint = machine_fingerprint()
    if not reprobe and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == fingerprint:
                return Link(data["name"], data["bandwidth_bytes_per_s"], data["latency_s"], data["source"])
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    link = probe_link(transport)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "name": link.name,
        "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
        "latency_s": link.latency_s,
        "source": link.source,
        "fingerprint": fingerprint,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return link
