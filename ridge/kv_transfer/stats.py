"""KV transfers as plain data: counters since the engine started and the latest transfers."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RECENT_TRANSFERS = 256


@dataclass(frozen=True)
class TransferRecord:
    """One transfer as the consumer saw it: blocks pulled (and blocks its prefix cache held),
    bytes, and seconds from posting the receive to its arrival."""

    request_id: str
    peer_id: str
    blocks: int
    blocks_skipped: int
    bytes: int
    seconds: float


@dataclass
class KVTransferStats:
    role: str
    engine_id: str
    num_peers: int = 0
    transfers: int = 0  # producer: pulls served; consumer: transfers received
    blocks: int = 0  # producer: blocks sent; consumer: blocks received
    bytes: int = 0
    blocks_skipped: int = 0  # consumer: blocks its prefix cache already held (not sent)
    seconds: float = 0.0  # consumer: time the transfers took, summed
    failures: int = 0  # transfers that failed, or pulls of unknown transfers
    expired: int = 0  # producer: parked requests nobody pulled in time
    parked: int = 0  # producer: requests whose blocks wait for a pull
    receiving: int = 0  # consumer: requests whose cache is on its way
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_TRANSFERS))

    def snapshot(self, parked: int, receiving: int, num_peers: int) -> KVTransferStats:
        return KVTransferStats(
            self.role,
            self.engine_id,
            num_peers,
            self.transfers,
            self.blocks,
            self.bytes,
            self.blocks_skipped,
            self.seconds,
            self.failures,
            self.expired,
            parked,
            receiving,
            deque(self.recent, maxlen=RECENT_TRANSFERS),
        )
