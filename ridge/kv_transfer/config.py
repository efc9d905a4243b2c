"""``--kv-transfer-config`` (vLLM's flag) and the per-request ``kv_transfer_params``.

    {"kv_role": "kv_producer", "kv_port": 14600}    runs prompts only: computes their KV cache
                                                    (and a first token), keeps the blocks until
                                                    a consumer has pulled them
    {"kv_role": "kv_consumer", "kv_port": 14700}    takes handed-over requests and decodes them

``kv_ip`` (default 127.0.0.1) and ``kv_port`` are where the instance's KV endpoint listens (a
``torch.distributed`` TCPStore; the point-to-point groups between instances meet on the
consumer's). ``kv_connector`` names the transport: only ``TorchDistributedConnector``
(gloo on CPU, NCCL between two GPUs) ships. ``kv_buffer_device`` (vLLM's key): "cuda" (the
default) sends a GPU instance's blocks GPU to GPU over NCCL; "cpu" stages them through host
memory over gloo, as two instances sharing one GPU always do (NCCL refuses a pair on one
device). vLLM's other keys (``kv_rank``, ``kv_parallel_size``, ``kv_buffer_size``,
``kv_connector_extra_config``, ``engine_id``) are accepted and unused.

A request's ``kv_transfer_params`` (what the router sends; vLLM's field of the same name):

    producer:  {"do_remote_decode": true}
    consumer:  {"do_remote_prefill": true, "remote_engine_id": ..., "prompts": [...]}
               per prompt, what the producer answered: its transfer ids, first tokens (and
               their logprobs, and the seeded samples' generator states), one per sample
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from ridge.flags import json_object

KV_ROLES = ("kv_producer", "kv_consumer")
CONNECTORS = ("TorchDistributedConnector",)
DEFAULT_KV_IP = "127.0.0.1"
DEFAULT_KV_PORT = 14579
_ACCEPTED_UNUSED = {
    "kv_rank",
    "kv_parallel_size",
    "kv_buffer_size",
    "kv_connector_extra_config",
    "engine_id",
    "kv_load_failure_policy",
}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_ip: str = DEFAULT_KV_IP
    kv_port: int = DEFAULT_KV_PORT
    kv_connector: str = CONNECTORS[0]
    kv_buffer_device: str = "cuda"

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"kv_transfer_config: kv_connector {self.kv_connector!r} is not available; ridge ships "
                f"{', '.join(CONNECTORS)} (torch.distributed)"
            )
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a port number, got {self.kv_port!r}")
        if self.kv_buffer_device not in ("cuda", "cpu"):
            raise ValueError(f"kv_transfer_config: kv_buffer_device must be cuda or cpu, got {self.kv_buffer_device!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config: kv_ip must be an address, got {self.kv_ip!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @classmethod
    def parse(cls, value: Any) -> KVTransferConfig | None:
        """None, a ``KVTransferConfig``, a dict or its JSON text; ValueError naming what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        value = {k: v for k, v in json_object(value, "--kv-transfer-config").items() if k not in _ACCEPTED_UNUSED}
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; known: kv_role, kv_ip, kv_port, "
                "kv_connector, kv_buffer_device"
            )
        if "kv_role" not in value:
            raise ValueError(f"kv_transfer_config needs kv_role ({' or '.join(KV_ROLES)})")
        return cls(**value)

    def to_dict(self) -> dict:
        return {
            "kv_role": self.kv_role,
            "kv_ip": self.kv_ip,
            "kv_port": self.kv_port,
            "kv_connector": self.kv_connector,
        }


@dataclass(frozen=True)
class KVTransferParams:
    """One prompt's part in a transfer, as the engine takes it.

    ``do_remote_decode`` (producer): compute the prompt and each sample's first token, then
    keep the blocks after the request ends, for a consumer to pull (the request's output then
    carries ``kv_handover``: the transfer ids and the seeded samples' generator states).
    ``do_remote_prefill`` (consumer): the prompt's cache comes from engine
    ``remote_engine_id``, computed over ``num_prompt_tokens`` tokens (checked against this
    instance's tokenization), and each of the n samples starts from what the producer sampled:
    ``transfer_ids[i]``, ``first_tokens[i]``, ``first_logprobs[i]`` (``(logprob, [(token,
    logprob), ...])``, when logprobs are asked) and ``generator_states[i]`` (seeded samples).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    num_prompt_tokens: int | None = None
    transfer_ids: tuple[str, ...] = ()
    first_tokens: tuple[int, ...] = ()
    first_logprobs: tuple = ()
    generator_states: tuple = ()


@dataclass(frozen=True)
class RemoteKV:
    """A consumer's sequence: the producer and transfer its prompt's cache comes from."""

    peer_id: str
    transfer_id: str


def handover_to_json(handover: dict) -> dict:
    """A producer's handover of one prompt as JSON (generator states in base64)."""
    out = dict(handover)
    out["generator_states"] = [
        None if s is None else base64.b64encode(s).decode() for s in handover["generator_states"]
    ]
    return out


def request_params(raw: Any, num_prompts: int, n: int = 1) -> list[KVTransferParams] | None:
    """A request body's ``kv_transfer_params`` as one ``KVTransferParams`` per prompt (None when
    absent); ValueError naming what is wrong.

        {"do_remote_decode": true}
        {"do_remote_prefill": true, "remote_engine_id": ..., "prompts": [a producer's handover per prompt]}
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("kv_transfer_params must be an object")
    if raw.get("do_remote_decode"):
        return [KVTransferParams(do_remote_decode=True)] * num_prompts
    if not raw.get("do_remote_prefill"):
        return None
    engine_id, prompts = raw.get("remote_engine_id"), raw.get("prompts")
    if not isinstance(engine_id, str) or not isinstance(prompts, list):
        raise ValueError("kv_transfer_params with do_remote_prefill needs remote_engine_id and prompts")
    if len(prompts) != num_prompts:
        raise ValueError(f"kv_transfer_params hands over {len(prompts)} prompts for {num_prompts}")
    out = []
    for p in prompts:
        try:
            ids, tokens = p["transfer_ids"], p["first_tokens"]
            logprobs, states = p.get("first_logprobs") or [None] * len(ids), p.get("generator_states") or []
            count = int(p["num_prompt_tokens"])
            if not (len(ids) == len(tokens) == len(logprobs) == n) or len(states) not in (0, n) or count < 1:
                raise ValueError(f"it hands over {len(ids)} samples, the request asks for n = {n}")
            decoded = tuple(None if s is None else base64.b64decode(s) for s in states) or (None,) * n
            first_logprobs = tuple(
                None if lp is None else (float(lp[0]), [(int(t), float(v)) for t, v in lp[1]]) for lp in logprobs
            )
            out.append(
                KVTransferParams(
                    do_remote_prefill=True,
                    remote_engine_id=engine_id,
                    num_prompt_tokens=count,
                    transfer_ids=tuple(str(t) for t in ids),
                    first_tokens=tuple(int(t) for t in tokens),
                    first_logprobs=first_logprobs,
                    generator_states=decoded,
                )
            )
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise ValueError(f"kv_transfer_params: a prompt's handover is malformed ({exc})") from None
    return out
