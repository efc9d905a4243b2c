"""KV connectors: KV blocks moved straight from one instance's pool into another's.

One connector per worker rank (it reads and writes that rank's pool shard); rank 0's also
carries the control messages. The engine drives it through the step's plan (plain data):

    plan.kv_sends   producer: gather these blocks, send them to the consumer (tag)
    plan.kv_recvs   consumer: receive a transfer (tag) for these blocks
    plan.kv_loaded  consumer: the transfer arrived: copy it into the blocks before the forward

and, on rank 0 only, ``poll`` (what arrived: pulls, pulls served, finished or failed
receives, peers gone), ``wait``, ``send_control``, and ``offer`` / ``withdraw``: a producer of
one rank offers its parked blocks, and its listener serves a pull at once, while the engine
runs a step (a long prefill would otherwise hold the transfer up until the step ends).
``KVConnector`` is that interface; ``make_connector`` the one factory. Only ``TorchDistributedConnector`` ships:

* Every instance hosts a ``TCPStore`` at its ``kv_ip:kv_port`` (rank 0), where each rank
  publishes its ``KVLayout``.
* ``connect(peer)``, called on both sides (the router asks each), checks that the peer's
  layout agrees with this one (model, block size, formats, shapes, tensor-parallel size), then
  builds two-process groups per rank pair (producer rank r with consumer rank r) on the
  consumer's store: gloo for the control messages (host memory), and for the blocks the same
  gloo group, or NCCL where both instances run on GPUs, two different ones, and neither asked
  for ``kv_buffer_device: "cpu"`` (a GPU's blocks otherwise travel through host memory: NCCL
  refuses two ranks on one device). The groups time out after ``RIDGE_KV_TIMEOUT`` seconds,
  and a peer that dies closes its connections, which fails what waits on it at once.
* Data: one message per transfer and rank: a 16-byte header (1: the blocks follow; 0: the
  producer does not hold that transfer, zeros follow), then every layer's K and V codes (and
  scales, for an int8/fp8 cache: a quantized cache moves quantized) of the blocks.
* Control (rank 0 to rank 0, tag 0, a 512-byte JSON message): the consumer's ``pull``
  (transfer id, first block, count, tag).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from ridge.kv.cache import PagedKV
from ridge.kv_transfer.config import KVTransferConfig

CONTROL_TAG = 0
CONTROL_BYTES = 512
HEADER_BYTES = 16  # a transfer's status, before its blocks (keeps them aligned for any dtype)
# A listener waits for the peer's next control message for as long as the pair lives (a
# peer that dies closes the connection, which ends the wait at once).
LISTEN_TIMEOUT = datetime.timedelta(days=365)
# A transfer in flight, and every wait on a live peer. A producer serves pulls between its
# steps, and a step with a long prefill (two 1,024-token prompts on one CPU core: over 30 s)
# delays them; a dead peer closes its connections, which ends every wait on it at once.
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0  # reaching a peer's store, both sides joining the pair group

logger = logging.getLogger(__name__)


def transfer_timeout() -> float:
    return float(os.environ.get("RIDGE_KV_TIMEOUT", DEFAULT_TIMEOUT_S))


def connect_timeout() -> float:
    return float(os.environ.get("RIDGE_KV_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S))


# -- plain data ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """What two instances must share for one's blocks to mean the same in the other's pool."""

    model: str  # a fingerprint of the checkpoint's config and weights
    num_layers: int
    num_heads: int  # this rank's KV heads
    head_dim: int
    keys_only: bool
    dtype: str
    kv_cache_dtype: str
    block_size: int
    tensor_parallel_size: int
    device_type: str
    bytes_per_block: int  # this rank's share of one block, every layer

    def mismatch(self, other: KVLayout) -> str | None:
        """Why ``other``'s blocks cannot go into this pool (None: they can)."""
        if other.model != self.model:
            return "serves another model (its checkpoint or weights differ from this instance's)"
        if other.tensor_parallel_size != self.tensor_parallel_size:
            return (
                f"runs tensor parallel size {other.tensor_parallel_size}, this instance {self.tensor_parallel_size} "
                "(paired instances split the KV heads alike)"
            )
        if other.block_size != self.block_size:
            return f"has block size {other.block_size}, this instance {self.block_size}"
        if (other.kv_cache_dtype, other.dtype) != (self.kv_cache_dtype, self.dtype):
            return (
                f"keeps its KV cache as {other.kv_cache_dtype} ({other.dtype}), this instance as "
                f"{self.kv_cache_dtype} ({self.dtype}): the formats must agree (--kv-cache-dtype, --dtype)"
            )
        if other.device_type != self.device_type:
            return f"runs on {other.device_type}, this instance on {self.device_type}"
        if other != self:
            return f"has another KV layout ({other}) than this instance ({self})"
        return None


@dataclass(frozen=True)
class PeerInfo:
    """Where another instance's KV endpoint is (what ``/kv/info`` reports)."""

    engine_id: str
    kv_role: str
    kv_ip: str
    kv_port: int
    tensor_parallel_size: int = 1

    @classmethod
    def from_dict(cls, raw: dict) -> PeerInfo:
        try:
            return cls(
                str(raw["engine_id"]),
                str(raw["kv_role"]),
                str(raw["kv_ip"]),
                int(raw["kv_port"]),
                int(raw.get("tensor_parallel_size", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a KV peer needs engine_id, kv_role, kv_ip and kv_port ({exc})") from None

    @property
    def where(self) -> str:
        return f"{self.kv_role} at {self.kv_ip}:{self.kv_port}"


@dataclass
class KVSend:
    """Producer: send blocks ``block_ids`` (None: ``num_blocks`` blocks of zeros, to answer a
    pull whose transfer is unknown) to ``peer_id`` under ``tag``."""

    peer_id: str
    tag: int
    block_ids: list[int] | None
    num_blocks: int


@dataclass
class KVRecv:
    """Consumer: receive ``peer_id``'s transfer ``tag`` into blocks ``block_ids`` of ``req_id``."""

    peer_id: str
    req_id: str
    tag: int
    block_ids: list[int]


@dataclass
class KVEvents:
    """What rank 0's connector saw since the last poll."""

    pulls: list[tuple[str, dict]] = field(default_factory=list)  # (consumer id, pull message)
    served: list[tuple[str, int]] = field(default_factory=list)  # (transfer id, blocks sent): free them
    refused: list[tuple[str, str]] = field(default_factory=list)  # (consumer id, why)
    received: list[tuple[str, float, int]] = field(default_factory=list)  # (req id, seconds, bytes)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (req id, why)
    dead: list[str] = field(default_factory=list)  # peers whose connection closed


class KVConnector(Protocol):
    layout: KVLayout

    def connect(self, peer: PeerInfo) -> None: ...

    def alive_peers(self) -> list[str]: ...

    def start_sends(self, sends: list[KVSend]) -> None: ...

    def start_recvs(self, recvs: list[KVRecv]) -> None: ...

    def finish_recvs(self, req_ids: list[str]) -> None: ...

    def drop(self, req_ids: list[str]) -> None: ...

    def poll(self) -> KVEvents: ...

    def wait(self, timeout: float) -> None: ...

    def offer(self, transfer_id: str, block_ids: list[int]) -> None: ...

    def withdraw(self, transfer_id: str) -> bool: ...

    def set_wakeup(self, callback) -> None: ...

    def send_control(self, peer_id: str, message: dict) -> None: ...

    def close(self) -> None: ...


def make_connector(
    config: KVTransferConfig, engine_id: str, layout: KVLayout, pools: list[PagedKV], rank: int, device: torch.device
) -> KVConnector:
    """The connector ``config.kv_connector`` names (only the torch.distributed one ships)."""
    return TorchDistributedConnector(config, engine_id, layout, pools, rank, device)


# -- the pool's bytes ----------------------------------------------------------------------------


def pool_tensors(pools: list[PagedKV]) -> list[torch.Tensor]:
    """Every tensor a block has a slice of, in a fixed order: codes first, then scales (so each
    part of a staging buffer starts aligned for its dtype)."""
    codes, scales = [], []
    for layer in pools:
        codes.append(layer.k)
        if layer.v is not layer.k:
            codes.append(layer.v)
        if layer.k_scale is not None:
            scales.append(layer.k_scale)
            if layer.v_scale is not layer.k_scale:
                scales.append(layer.v_scale)
    return codes + scales


def block_bytes(pools: list[PagedKV]) -> int:
    return sum(t[0].numel() * t.element_size() for t in pool_tensors(pools))


def gather_blocks(pools: list[PagedKV], block_ids: list[int]) -> torch.Tensor:
    """A transfer's message: the header (status 1), then the blocks' bytes, every tensor in
    ``pool_tensors`` order, as one uint8 tensor."""
    device = pools[0].k.device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)
    header[0] = 1
    parts = [t.index_select(0, index).reshape(-1).view(torch.uint8) for t in pool_tensors(pools)]
    return torch.cat([header, *parts])


def refusal(num_blocks: int, bytes_per_block: int, device: torch.device) -> torch.Tensor:
    """The message that answers a pull of a transfer this producer does not hold: status 0."""
    return torch.zeros(HEADER_BYTES + num_blocks * bytes_per_block, dtype=torch.uint8, device=device)


def scatter_blocks(pools: list[PagedKV], block_ids: list[int], message: torch.Tensor) -> None:
    """Write ``gather_blocks``' blocks into blocks ``block_ids``."""
    index = torch.tensor(block_ids, dtype=torch.long, device=pools[0].k.device)
    data = message[HEADER_BYTES:]
    offset = 0
    for t in pool_tensors(pools):
        size = len(block_ids) * t[0].numel() * t.element_size()
        part = data[offset : offset + size]
        offset += size
        t.index_copy_(0, index, part.view(t.dtype).view(len(block_ids), *t.shape[1:]))
    if offset != data.numel():
        raise ValueError(f"a transfer of {data.numel()} bytes does not fill {len(block_ids)} blocks ({offset} bytes)")


# -- torch.distributed -------------------------------------------------------------------------


def gpu_to_gpu(mine: dict, theirs: dict) -> bool:
    """Whether a pair's blocks go GPU to GPU (NCCL): both ranks on GPUs, different ones, and
    neither asked to stage through host memory. Symmetric: both sides read the same two
    records (``_device_identity``), so they build the same groups."""
    if mine.get("gpu") is None or theirs.get("gpu") is None or mine["gpu"] == theirs["gpu"]:
        return False
    return not (mine.get("host_buffer") or theirs.get("host_buffer"))


@dataclass
class _Peer:
    info: PeerInfo
    group: object  # gloo: control messages, and the blocks where ``data`` is this group too
    data: object  # the blocks' group: NCCL between two GPUs, else ``group``
    pair_rank: int  # the peer's rank in the pair group
    alive: bool = True

    @property
    def staged(self) -> bool:
        """Whether the blocks travel through host memory (gloo) rather than GPU to GPU."""
        return self.data is self.group


@dataclass
class _Recv:
    recv: KVRecv
    buffer: torch.Tensor
    future: Future
    start: float


class TorchDistributedConnector:
    """See the module docstring."""

    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        layout: KVLayout,
        pools: list[PagedKV],
        rank: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.layout = layout
        self.pools = pools
        self.rank = rank
        self.device = device
        self.is_producer = config.is_producer
        self.peers: dict[str, _Peer] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiters = ThreadPoolExecutor(8, thread_name_prefix="ridge-kv-wait")
        self._recvs: dict[str, _Recv] = {}
        self._sends: list[tuple[Future, torch.Tensor]] = []
        self._closed = False
        self._offer_lock = threading.Lock()
        self._offered: dict[str, list[int]] = {}  # producer: transfer id -> parked block ids
        self._offering = False
        self._wakeup = None  # called (on a connector thread) when an event is ready
        timeout = datetime.timedelta(seconds=connect_timeout())
        if rank == 0:
            try:
                self.store = dist.TCPStore(
                    config.kv_ip, config.kv_port, None, True, timeout=timeout, wait_for_workers=False, multi_tenant=True
                )
            except Exception as exc:  # the port is taken, the address is not this machine's ...
                raise ValueError(
                    f"kv_transfer_config: cannot listen on {config.kv_ip}:{config.kv_port} ({exc})"
                ) from None
        else:
            self.store = self._client(config.kv_ip, config.kv_port, "this instance's own KV endpoint")
        self.store.set(f"layout/{rank}", json.dumps(asdict(layout)))
        self.identity = self._device_identity()
        self.store.set(f"device/{rank}", json.dumps(self.identity))

    # -- pairing ------------------------------------------------------------------------------
    def _device_identity(self) -> dict:
        """What decides the blocks' path: this rank's GPU (None on CPU) and whether it asked to
        stage through host memory."""
        gpu = None
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            gpu = f"{socket.gethostname()}/{getattr(props, 'uuid', self.device.index)}"
        return {"gpu": gpu, "host_buffer": self.config.kv_buffer_device == "cpu"}

    def _gpu_to_gpu(self, peer_store) -> bool:
        try:
            theirs = json.loads(peer_store.get(f"device/{self.rank}"))
        except Exception:  # an instance that does not publish it: stage
            return False
        return gpu_to_gpu(self.identity, theirs)

    def _client(self, host: str, port: int, what: str):
        try:
            return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=connect_timeout()))
        except Exception as exc:
            raise ValueError(
                f"cannot reach {what} at {host}:{port} within {connect_timeout():.0f} s ({type(exc).__name__})"
            ) from None

    def connect(self, peer: PeerInfo) -> None:
        """Pair with ``peer`` (idempotent while the pair is alive); ValueError when the peer
        cannot be reached, plays the same role, or its layout differs."""
        known = self.peers.get(peer.engine_id)
        if known is not None and known.alive:
            return
        if peer.engine_id == self.engine_id:
            raise ValueError("an instance cannot be its own KV peer")
        if (peer.kv_role == "kv_producer") == self.is_producer:
            raise ValueError(
                f"the {peer.where} plays this instance's own role ({peer.kv_role}): pair a producer with a consumer"
            )
        peer_store = self._client(peer.kv_ip, peer.kv_port, f"the {peer.kv_role}")
        try:
            peer_store.wait([f"layout/{self.rank}"], datetime.timedelta(seconds=connect_timeout()))
            theirs = KVLayout(**json.loads(peer_store.get(f"layout/{self.rank}")))
        except Exception as exc:
            raise ValueError(f"the {peer.where} did not publish its KV layout for rank {self.rank} ({exc})") from None
        problem = self.layout.mismatch(theirs)
        if problem is not None:
            raise ValueError(f"the {peer.where} {problem}")
        producer, consumer = (self.engine_id, peer.engine_id) if self.is_producer else (peer.engine_id, self.engine_id)
        meeting = peer_store if self.is_producer else self.store
        prefix = f"pair/{producer}/{consumer}/{self.rank}"
        pair_rank = 0 if self.is_producer else 1
        try:
            group = self._pair_group(dist.PrefixStore(prefix, meeting), pair_rank, nccl=False)
            data = group
            if self._gpu_to_gpu(peer_store):
                data = self._pair_group(dist.PrefixStore(prefix + "/nccl", meeting), pair_rank, nccl=True)
        except Exception as exc:
            raise ValueError(
                f"the {peer.where} did not join the KV transfer group within {connect_timeout():.0f} s "
                f"({type(exc).__name__}); both sides must be asked to connect"
            ) from None
        self.peers[peer.engine_id] = entry = _Peer(peer, group, data, 1 - pair_rank)
        if self.rank == 0:
            threading.Thread(target=self._listen, args=(entry,), name="ridge-kv-control", daemon=True).start()
        path = "through host memory" if entry.staged and self.device.type == "cuda" else "direct"
        logger.info("KV transfer: paired with the %s (%s; blocks %s)", peer.where, peer.engine_id, path)

    def alive_peers(self) -> list[str]:
        """The engine ids of the peers whose pair still stands."""
        return sorted(pid for pid, peer in self.peers.items() if peer.alive)

    def _pair_group(self, store, pair_rank: int, nccl: bool):
        timeout = datetime.timedelta(seconds=transfer_timeout())
        if nccl:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, pair_rank, 2, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.config.kv_ip)]
        return dist.ProcessGroupGloo(store, pair_rank, 2, options)

    def _peer(self, peer_id: str) -> _Peer:
        peer = self.peers.get(peer_id)
        if peer is None:
            raise ValueError(f"instance {peer_id} is not a connected KV peer")
        if not peer.alive:
            raise ValueError(f"the {peer.info.where} is gone")
        return peer

    # -- control (rank 0) ------------------------------------------------------------------------
    def _listen(self, peer: _Peer) -> None:
        buffer = torch.empty(CONTROL_BYTES, dtype=torch.uint8)
        while not self._closed:
            try:
                peer.group.recv([buffer], peer.pair_rank, CONTROL_TAG).wait(LISTEN_TIMEOUT)
            except Exception as exc:
                if not self._closed:
                    peer.alive = False
                    logger.warning("KV transfer: lost the %s (%s: %s)", peer.info.where, type(exc).__name__, exc)
                    self._put(("dead", peer.info.engine_id))
                return
            message = json.loads(bytes(buffer.tolist()).rstrip(b" ").decode())
            if message.get("type") != "pull":
                logger.warning("KV transfer: an unknown control message from the %s: %s", peer.info.where, message)
            elif self.serves_pulls:
                self._serve(peer, message)
            else:
                self._put(("pulls", (peer.info.engine_id, message)))

    # -- serving pulls at once (a producer of one rank) ------------------------------------------
    @property
    def serves_pulls(self) -> bool:
        """A producer whose engine offers its parked transfers (``offer``) serves pulls from the
        listener, while its engine runs a step: a long prefill does not hold the transfer up.
        (Under tensor parallelism every rank sends its shard, so pulls go through the plan.)"""
        return self.is_producer and self._offering

    def offer(self, transfer_id: str, block_ids: list[int]) -> None:
        """Producer, rank 0: parked blocks a consumer may pull now (they do not change while parked)."""
        with self._offer_lock:
            self._offering = True
            self._offered[transfer_id] = list(block_ids)

    def withdraw(self, transfer_id: str) -> bool:
        """Take back an offer (the blocks expire); False when a pull already claimed it (its
        ``served`` event comes once the blocks have been read)."""
        with self._offer_lock:
            return self._offered.pop(transfer_id, None) is not None

    def _serve(self, peer: _Peer, message: dict) -> None:
        tid, first, count, tag = (message.get("transfer_id"), int(message["first_block"]),
                                  int(message["num_blocks"]), int(message["tag"]))  # fmt: skip
        with self._offer_lock:
            block_ids = self._offered.pop(tid, None)
        why = None
        if count and block_ids is not None and len(block_ids[first : first + count]) == count:
            data = self._outgoing(peer, gather_blocks(self.pools, block_ids[first : first + count]))
        elif count:
            why = f"transfer {tid!r} is unknown here (expired or never produced)" if block_ids is None else (
                f"transfer {tid!r} holds fewer than the {first + count} blocks asked for")  # fmt: skip
            data = refusal(count, self.layout.bytes_per_block, self._buffer_device(peer))
        if count:
            try:
                peer.data.send([data], peer.pair_rank, tag).wait(datetime.timedelta(seconds=transfer_timeout()))
            except Exception as exc:
                logger.warning("KV transfer %d to the %s failed: %s", tag, peer.info.where, type(exc).__name__)
        if block_ids is not None:  # read (or not needed): the engine may free them
            self._put(("served", (tid, count if why is None else 0)))
        if why is not None:
            self._put(("refused", (peer.info.engine_id, why)))

    def send_control(self, peer_id: str, message: dict) -> None:
        """Rank 0: one control message to a peer's rank 0; ValueError when the peer is gone."""
        peer = self._peer(peer_id)
        data = json.dumps(message).encode()
        if len(data) > CONTROL_BYTES:
            raise ValueError(f"a KV control message is longer than {CONTROL_BYTES} bytes")
        buffer = torch.frombuffer(bytearray(data.ljust(CONTROL_BYTES)), dtype=torch.uint8)
        try:
            peer.group.send([buffer], peer.pair_rank, CONTROL_TAG).wait(datetime.timedelta(seconds=transfer_timeout()))
        except Exception as exc:
            peer.alive = False
            raise ValueError(f"the {peer.info.where} is gone ({type(exc).__name__})") from None

    def _put(self, event) -> None:
        self._events.put(event)
        self._wake.set()
        if self._wakeup is not None:
            self._wakeup()

    def set_wakeup(self, callback) -> None:
        """``callback()`` runs whenever an event is ready to poll (an idle engine loop wakes)."""
        self._wakeup = callback

    def poll(self) -> KVEvents:
        events = KVEvents()
        self._wake.clear()
        while True:
            try:
                kind, payload = self._events.get_nowait()
            except queue.Empty:
                break
            getattr(events, kind).append(payload)  # kinds are KVEvents' fields
        self._sends = [(f, b) for f, b in self._sends if not f.done()]  # staging of finished sends
        return events

    def wait(self, timeout: float) -> None:
        """Rank 0: return when an event is ready to poll, or after ``timeout`` seconds."""
        self._wake.wait(timeout)

    # -- data ------------------------------------------------------------------------------------
    def _buffer_device(self, peer: _Peer) -> torch.device:
        return torch.device("cpu") if peer.staged else self.device

    def _outgoing(self, peer: _Peer, data: torch.Tensor) -> torch.Tensor:
        """A message where the peer's group reads it: staged through host memory, or as is."""
        return data.cpu() if peer.staged else data

    def start_sends(self, sends: list[KVSend]) -> None:
        for send in sends:
            try:
                peer = self._peer(send.peer_id)
            except ValueError as exc:
                logger.warning("KV transfer: not sent: %s", exc)
                continue
            if send.block_ids is None:
                data = refusal(send.num_blocks, self.layout.bytes_per_block, self._buffer_device(peer))
            else:
                data = self._outgoing(peer, gather_blocks(self.pools, send.block_ids))
            work = peer.data.send([data], peer.pair_rank, send.tag)
            self._sends.append((self._waiters.submit(self._wait_send, work, peer, send.tag), data))

    def _wait_send(self, work, peer: _Peer, tag: int) -> None:
        try:
            work.wait()
        except Exception as exc:
            logger.warning("KV transfer %d to the %s failed: %s", tag, peer.info.where, type(exc).__name__)

    def start_recvs(self, recvs: list[KVRecv]) -> None:
        for recv in recvs:
            size = HEADER_BYTES + len(recv.block_ids) * self.layout.bytes_per_block
            data = torch.empty(size, dtype=torch.uint8, device=self.device)
            start = time.monotonic()
            try:
                peer = self._peer(recv.peer_id)
                if peer.staged:
                    data = torch.empty(size, dtype=torch.uint8)
                work = peer.data.recv([data], peer.pair_rank, recv.tag)
            except Exception as exc:
                future: Future = Future()
                future.set_exception(exc)
                self._recvs[recv.req_id] = _Recv(recv, data, future, start)
                self._report(recv.req_id, future)
                continue
            future = self._waiters.submit(work.wait)
            self._recvs[recv.req_id] = _Recv(recv, data, future, start)
            future.add_done_callback(lambda f, rid=recv.req_id: self._report(rid, f))

    def _report(self, req_id: str, future: Future) -> None:
        if self.rank != 0:
            return
        entry = self._recvs.get(req_id)
        if entry is None:  # dropped (aborted) meanwhile
            return
        exc = future.exception()
        peer = self.peers.get(entry.recv.peer_id)
        where = peer.info.where if peer is not None else f"instance {entry.recv.peer_id}"
        if exc is not None:
            self._put(("failed", (req_id, f"the KV cache transfer from the {where} failed: {exc}")))
        elif int(entry.buffer[0]) != 1:
            why = f"the {where} does not hold the prompt's KV cache (its transfer expired, or never was)"
            self._put(("failed", (req_id, why)))
        else:
            size = entry.buffer.numel() - HEADER_BYTES
            self._put(("received", (req_id, time.monotonic() - entry.start, size)))

    def finish_recvs(self, req_ids: list[str]) -> None:
        """Copy arrived transfers into their blocks (a rank whose part is still on its way
        waits for it, within the transfer timeout)."""
        for req_id in req_ids:
            entry = self._recvs.pop(req_id)
            entry.future.result(timeout=transfer_timeout())
            scatter_blocks(self.pools, entry.recv.block_ids, entry.buffer.to(self.device))

    def drop(self, req_ids: list[str]) -> None:
        """Forget receives of requests that ended (their staging goes when the transfer does)."""
        for req_id in req_ids:
            self._recvs.pop(req_id, None)

    def close(self) -> None:
        """Stop serving: no more transfers start (the listeners end with the process)."""
        self._closed = True
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self.peers.clear()
