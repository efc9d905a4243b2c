"""Which instance takes a request: prefix affinity, then load (SGLang's cache-aware routing).

Each instance keeps, per the router, the prompt prefixes it was sent: a prompt's text is cut
into ``chunk_chars`` pieces, each named by a hash chained to the one before it (equal names,
equal prefixes), held in an LRU of ``max_entries`` names per instance. For a new prompt:

    match(i) = leading chunks of the prompt that instance i was sent / the prompt's chunks

If the best match reaches ``cache_threshold`` and that instance is not much busier than the
least loaded one (``load <= min load + balance_threshold``), the prompt goes there (its prefix
cache likely holds the prefix); otherwise to the least loaded instance. An instance's load is
what the router has in flight there plus the sequences it reports waiting (``/metrics``), its
KV-cache usage breaking ties. Either way the prompt's chunks are recorded for the instance.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Instance:
    """One ``ridge serve`` behind the router, as the router sees it."""

    url: str
    role: str  # "prefill", "decode" or "replica"
    healthy: bool = False
    in_flight: int = 0  # requests the router has sent it that have not ended
    waiting: float = 0.0  # sequences it reports waiting (its /metrics)
    running: float = 0.0
    kv_usage: float = 0.0
    kv_info: dict | None = None  # its /kv/info (prefill and decode instances)
    kv_metrics: dict[str, float] = field(default_factory=dict)  # its ridge_kv_transfer_* counters
    last_seen: float = 0.0  # monotonic time of its last good health check
    requests: int = 0  # sent, since the router started
    errors: int = 0  # ended with an error the instance caused (unreachable, broke off)
    last_error: str = ""

    @property
    def load(self) -> float:
        return self.in_flight + self.waiting

    @property
    def engine_id(self) -> str | None:
        return self.kv_info.get("engine_id") if self.kv_info else None


def prefix_chunks(text: str, chunk_chars: int) -> list[bytes]:
    """The chained names of ``text``'s leading whole chunks (a partial last chunk included)."""
    names, parent = [], b""
    for start in range(0, len(text), chunk_chars):
        parent = hashlib.blake2b(parent + text[start : start + chunk_chars].encode(), digest_size=8).digest()
        names.append(parent)
    return names


class PrefixAffinity:
    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_threshold: float = 8.0,
        chunk_chars: int = 256,
        max_entries: int = 1 << 16,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_threshold = balance_threshold
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        self._seen: dict[str, OrderedDict[bytes, None]] = {}
        self._turns: dict[tuple[str, ...], itertools.count] = {}  # ties go round, per set of instances

    def match(self, instance: Instance, chunks: list[bytes]) -> float:
        seen = self._seen.get(instance.url)
        if not chunks or not seen:
            return 0.0
        n = 0
        for name in chunks:
            if name not in seen:
                break
            n += 1
        return n / len(chunks)

    def choose(self, instances: list[Instance], text: str) -> Instance:
        """The instance for a prompt ``text`` among ``instances`` (healthy ones; not empty)."""
        if not instances:
            raise ValueError("no instance to choose from")
        chunks = prefix_chunks(text, self.chunk_chars)
        turn = next(self._turns.setdefault(tuple(i.url for i in instances), itertools.count()))
        order = {inst.url: (turn + i) % len(instances) for i, inst in enumerate(instances)}  # fair ties
        least = min(instances, key=lambda i: (i.load, i.kv_usage, order[i.url]))
        best = max(instances, key=lambda i: (self.match(i, chunks), -i.load, -order[i.url]))
        chosen = least
        if self.match(best, chunks) >= self.cache_threshold and best.load <= least.load + self.balance_threshold:
            chosen = best
        self._record(chosen, chunks)
        return chosen

    def _record(self, instance: Instance, chunks: list[bytes]) -> None:
        seen = self._seen.setdefault(instance.url, OrderedDict())
        for name in chunks:
            seen[name] = None
            seen.move_to_end(name)
        while len(seen) > self.max_entries:
            seen.popitem(last=False)

    def forget(self, instance: Instance) -> None:
        """An instance that went away lost its cache (a restart starts empty)."""
        self._seen.pop(instance.url, None)
