"""The engine's side of disaggregated serving: prefill on a producer, decode on a consumer.

    producer                                          consumer
    request with do_remote_decode: runs the prompt
    and samples each sample's first token, as a
    colocated engine would; finishes; its blocks
    park (per sample)                            ->  (the router hands the request over, with
                                                      the first tokens, their logprobs and the
                                                      seeded samples' generator states)
                                                      request with do_remote_prefill: starts
                                                      from the first token; admission allocates
                                                      the prompt's blocks, finds the prefix
                                                      cache's share, posts a receive for the
                                 <- pull ----------   rest and pulls (rank 0's control message)
    the next plan sends the blocks, then frees them   the transfer lands; the request decodes
                                 --- blocks ------->  from its first token, exactly as the
                                                      colocated engine would go on

``KVTransferCoordinator`` turns the connector's events (rank 0's ``poll``) into scheduler
calls before each schedule, and sends the pulls after the plan that posted their receives has
run. The blocks themselves move in the workers (``plan.kv_sends`` / ``kv_recvs`` /
``kv_loaded``), every rank its own shard.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from ridge.engine.scheduler import Scheduler
from ridge.kv_transfer.config import KVTransferConfig, KVTransferParams
from ridge.kv_transfer.connector import KVConnector, PeerInfo
from ridge.kv_transfer.stats import KVTransferStats, TransferRecord

# The latest transfers ``info()`` lists (the stats keep more).
RECENT_IN_INFO = 64
# How long an engine with nothing to compute but a transfer under way waits for news.
IDLE_WAIT_S = 0.005

logger = logging.getLogger(__name__)


class KVTransferCoordinator:
    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        scheduler: Scheduler,
        executor,
        bytes_per_block: int,
        tensor_parallel_size: int,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.scheduler = scheduler
        self.executor = executor
        self.connector: KVConnector = executor.kv_connector  # rank 0's
        self.bytes_per_block = bytes_per_block
        self.tensor_parallel_size = tensor_parallel_size
        self.peers: dict[str, PeerInfo] = {}
        self.stats = KVTransferStats(config.kv_role, engine_id)
        self._skipped: dict[str, int] = {}  # consumer: request id -> blocks its cache held
        self._offered: set[str] = set()  # producer: parked transfers offered to the listener

    # -- identity and pairing ------------------------------------------------------------------
    def info(self) -> dict:
        """What a router or a peer needs to know of this instance (``/kv/info``)."""
        return {
            "engine_id": self.engine_id,
            **self.config.to_dict(),
            "tensor_parallel_size": self.tensor_parallel_size,
            "layout": asdict(self.connector.layout),
            "peers": self.connector.alive_peers(),
            "recent_transfers": [asdict(r) for r in list(self.stats.recent)[-RECENT_IN_INFO:]],
        }

    def connect(self, peer: dict) -> None:
        """Pair with ``peer`` (its ``info()``); ValueError with one clear line when it cannot."""
        info = PeerInfo.from_dict(peer)
        self.executor.kv_connect(info)
        self.peers[info.engine_id] = info

    def check_request(self, params: KVTransferParams, num_prompt_tokens: int, sampling) -> None:
        """ValueError when this instance cannot take a request with ``params`` (and ``sampling``)."""
        if params.do_remote_decode and not self.config.is_producer:
            raise ValueError("do_remote_decode: this instance is not a kv_producer")
        if params.do_remote_prefill:
            if self.config.is_producer:
                raise ValueError("do_remote_prefill: this instance is not a kv_consumer")
            if params.remote_engine_id not in self.peers:
                raise ValueError(
                    f"do_remote_prefill: instance {params.remote_engine_id} is not a connected kv_producer"
                )
            if params.num_prompt_tokens != num_prompt_tokens:
                raise ValueError(
                    f"the prompt has {num_prompt_tokens} tokens here but {params.num_prompt_tokens} on the "
                    "kv_producer: the two instances tokenize differently"
                )
            if len(params.transfer_ids) != sampling.n:
                raise ValueError(f"the kv_producer handed over {len(params.transfer_ids)} samples for n = {sampling.n}")
            if sampling.logprobs is not None and any(lp is None for lp in params.first_logprobs):
                raise ValueError("logprobs were asked, but the kv_producer's handover lacks the first token's")
            if sampling.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs need every prompt position's logits: not with do_remote_prefill")

    # -- around each step ---------------------------------------------------------------------
    def before_schedule(self) -> list[tuple[str, str]]:
        """Apply what arrived; returns the requests that failed, with why."""
        events = self.connector.poll()
        failures: list[tuple[str, str]] = []
        sched = self.scheduler
        for consumer, message in events.pulls:
            why = sched.add_pull(consumer, message)  # refused: answered with a status-0 message
            if why is not None:
                self.stats.failures += 1
                logger.warning("KV transfer: a pull from %s: %s", consumer, why)
            elif message.get("num_blocks"):
                self.stats.transfers += 1
                self.stats.blocks += int(message["num_blocks"])
                self.stats.bytes += int(message["num_blocks"]) * self.bytes_per_block
        for tid, blocks in events.served:  # the listener read them (a pull served at once)
            sched.release_parked(tid)
            self._offered.discard(tid)
            if blocks:
                self.stats.transfers += 1
                self.stats.blocks += blocks
                self.stats.bytes += blocks * self.bytes_per_block
        for consumer, why in events.refused:
            self.stats.failures += 1
            logger.warning("KV transfer: a pull from %s: %s", consumer, why)
        self.expire()
        for req_id, seconds, size in events.received:
            req = sched.receiving.get(req_id)
            if req is None:
                continue
            blocks = size // self.bytes_per_block
            self.stats.transfers += 1
            self.stats.blocks += blocks
            self.stats.bytes += size
            self.stats.seconds += seconds
            self.stats.recent.append(
                TransferRecord(req_id, req.remote.peer_id, blocks, self._skipped.pop(req_id, 0), size, seconds)
            )
            sched.kv_received(req_id)
        for req_id, why in events.failed:
            if sched.kv_failed(req_id) is not None:
                failures.append((req_id, why))
        for peer_id in events.dead:
            for req_id, req in list(sched.receiving.items()):
                if req.remote is not None and req.remote.peer_id == peer_id:
                    sched.kv_failed(req_id)
                    failures.append((req_id, f"the kv_producer {peer_id} went away during the KV transfer"))
        self.stats.failures += len(failures)
        return failures

    def expire(self, now: float | None = None) -> int:
        """Producer: free the parked blocks nobody pulled in time; returns how many transfers."""
        expired = 0
        for tid in self.scheduler.expired_parked(now):
            # an offer a pull has claimed is being read: its served event frees it
            if tid not in self._offered or self.connector.withdraw(tid):
                self._offered.discard(tid)
                self.scheduler.release_parked(tid)
                expired += 1
        self.stats.expired += expired
        return expired

    def after_step(self) -> list[tuple[str, str]]:
        """Offer what the step parked (a producer of one rank); send the pulls whose receives
        the plan just posted; returns the requests that failed."""
        if self.config.is_producer and self.tensor_parallel_size == 1:
            for tid, (req, _) in self.scheduler.parked.items():
                if tid not in self._offered:
                    self.connector.offer(tid, self.scheduler.kv.block_table(req))
                    self._offered.add(tid)
        failures = []
        pulls, self.scheduler.pulls = self.scheduler.pulls, []
        for pull in pulls:
            if pull.num_blocks:
                self._skipped[pull.req_id] = pull.first_block
            else:
                self.stats.blocks_skipped += pull.first_block
                self.stats.recent.append(TransferRecord(pull.req_id, pull.peer_id, 0, pull.first_block, 0, 0.0))
            try:
                self.connector.send_control(pull.peer_id, pull.message())
            except ValueError as exc:
                if self.scheduler.kv_failed(pull.req_id) is not None:
                    failures.append((pull.req_id, f"cannot pull the prompt's KV cache: {exc}"))
        self.stats.blocks_skipped += sum(p.first_block for p in pulls if p.num_blocks)
        self.stats.failures += len(failures)
        return failures

    def idle_wait(self) -> None:
        self.connector.wait(IDLE_WAIT_S)

    def snapshot(self) -> KVTransferStats:
        sched = self.scheduler
        return self.stats.snapshot(len(sched.parked), len(sched.receiving), len(self.connector.alive_peers()))
