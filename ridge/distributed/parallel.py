"""Tensor parallelism: which slice of each weight a rank holds, and the collectives between ranks.

ridge splits a model over N ranks the Megatron way (vLLM's too):

    q/k/v, gate/up        column-parallel: rank r holds rows [r n/N, (r+1) n/N) of the output
                          (its heads, its slice of the intermediate dimension)
    o, down               row-parallel: rank r holds the matching input columns; each rank's
                          output is a partial sum, and the layer all-reduces it
    KV heads              split like q's heads; with fewer KV heads than ranks each head is
                          replicated on N / Hkv ranks (rank r keeps head r Hkv / N)
    experts               every expert split along its intermediate dimension (gate/up rows,
                          down columns): one all-reduce per MoE layer, routed and shared alike
    latent attention      heads split (q_b, kv_b column-parallel, o row-parallel); the latent
                          projections and the latent cache are replicated
    embedding             replicated: a step reads only its tokens' rows, and a split would
                          cost an all-reduce per step
    lm_head               split over the vocabulary: its whole weight is read every step, so
                          the split divides that read like every other matrix; rank 0 gathers
                          the logits (one gather per step) and samples

A rank's share of a checkpoint tensor is a slice of the memory-mapped file (``Shard``): the
loader narrows the map, so each rank reads only its own bytes.

``TensorParallel`` is a rank's view of its group: ``rank``, ``size`` and the collectives on a
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA), each timed (``comm_s``).
``TensorParallel()`` is the single-process case: every collective is a no-op.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """A contiguous run ``[start, start + length)`` of a checkpoint tensor's dimension."""

    start: int
    length: int

    def of(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.narrow(dim, self.start, self.length)


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: one rank)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    comm_s: float = 0.0  # seconds spent in collectives since the last take_comm()
    shm: Any = None  # ranks of one machine: a ShmGroup for the collectives that fit it

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # -- which slice ----------------------------------------------------------------------
    def split(self, n: int, what: str) -> Shard:
        """This rank's even share of ``n`` (heads, rows, columns)."""
        if n % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide {what} ({n})")
        per = n // self.size
        return Shard(self.rank * per, per)

    def kv_heads(self, num_kv_heads: int) -> Shard:
        """The KV heads this rank keeps: an even share, or with fewer heads than ranks the
        one head it shares with N / Hkv - 1 other ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "the KV heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor parallel size {self.size} is neither a divisor nor a multiple of the KV heads ({num_kv_heads})"
            )
        return Shard(self.rank * num_kv_heads // self.size, 1)

    def vocab(self, vocab_size: int) -> Shard:
        """This rank's rows of the vocabulary (the last rank's share may be shorter)."""
        per = -(-vocab_size // self.size)
        start = min(self.rank * per, vocab_size)
        return Shard(start, min(per, vocab_size - start))

    # -- collectives ----------------------------------------------------------------------
    def take_comm(self) -> float:
        """Seconds spent in collectives since the last call."""
        spent, self.comm_s = self.comm_s, 0.0
        return spent

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce(x)
        else:
            self.group.allreduce([x]).wait()
        self._spent(start)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's (R, its vocabulary share) logits -> (R, V) on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        per = -(-vocab_size // self.size)
        if x.shape[-1] < per:  # the last rank's shorter share, padded to the common size
            x = torch.nn.functional.pad(x, (0, per - x.shape[-1]))
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            parts = self.shm.gather(x)
            out = None if parts is None else torch.cat(parts, dim=-1)[..., :vocab_size]
        elif self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.gather([parts], [x], dist.GatherOptions()).wait()
            out = torch.cat(parts, dim=-1)[..., :vocab_size]
        else:
            opts = dist.GatherOptions()
            opts.rootRank = 0
            self.group.gather([], [x], opts).wait()
            out = None
        self._spent(start)
        return out

    def broadcast_object(self, obj: Any = None, group: Any = None, timeout: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled into a byte tensor: a length, then the
        bytes); CPU tensors, so ``group`` is a gloo group (the compute group's by default).
        ``timeout`` (rank 0): how long a rank may take to receive it (a sender waits for its
        receivers: a hung rank would otherwise hold rank 0 for the group's whole timeout)."""
        if self.size == 1:
            return obj
        group = group or self.group
        device = torch.device("cpu")
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.long, device=device)
            _wait(group.broadcast([length]), timeout)
            _wait(group.broadcast([data.to(device)]), timeout)
            return obj
        length = torch.empty(1, dtype=torch.long, device=device)
        group.broadcast([length]).wait()
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        group.broadcast([data]).wait()
        return pickle.loads(data.cpu().numpy().tobytes())

    def gather_objects(self, obj: Any, group: Any = None, timeout: Any = None) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, in rank order (None elsewhere); CPU tensors, so
        ``group`` is a gloo group (the compute group's by default)."""
        if self.size == 1:
            return [obj]
        group = group or self.group
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        length = torch.tensor([len(data)], dtype=torch.long)
        lengths = [torch.empty_like(length) for _ in range(self.size)]
        _wait(group.allgather([lengths], [length]), timeout)
        longest = max(int(t.item()) for t in lengths)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.rank == 0:
            parts = [torch.empty_like(buf) for _ in range(self.size)]
            _wait(group.gather([parts], [buf], dist.GatherOptions()), timeout)
            return [
                pickle.loads(p[: int(n.item())].cpu().numpy().tobytes()) for p, n in zip(parts, lengths, strict=True)
            ]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        group.gather([], [buf], opts).wait()
        return None

    def _spent(self, start: float) -> None:
        self.comm_s += time.perf_counter() - start


def _wait(work, timeout) -> None:
    """A collective's completion, within ``timeout`` (None: the group's own)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
