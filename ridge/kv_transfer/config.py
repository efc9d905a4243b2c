"""``--kv-transfer-config`` (vLLM's flag) and the per-request ``kv_transfer_params``.

    {"kv_role": "kv_producer", "kv_port": 14600}    runs prompts only: computes their KV cache
                                                    (and a first token), keeps the blocks until
                                                    a consumer has pulled them
    {"kv_role": "kv_consumer", "kv_port": 14700}    takes handed-over requests and decodes them

``kv_ip`` (default 127.0.0.1) and ``kv_port`` are where the instance's KV endpoint listens (a
``torch.distributed`` TCPStore; the point-to-point groups between instances meet on the
consumer's). ``kv_connector`` names the transport: only ``TorchDistributedConnector``
(gloo on CPU, NCCL on CUDA) ships. vLLM's other keys (``kv_rank``, ``kv_parallel_size``,
``kv_buffer_size``, ``kv_buffer_device``, ``kv_connector_extra_config``, ``engine_id``) are
accepted and unused.

A request's ``kv_transfer_params`` (what the router sends; vLLM's field of the same name):

    producer:  {"do_remote_decode": true}
    consumer:  {"do_remote_prefill": true, "remote_engine_id": ..., "transfer_ids": [...],
                "num_prompt_tokens": [...]}       one transfer per prompt (what the producer answered)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer")
CONNECTORS = ("TorchDistributedConnector",)
DEFAULT_KV_IP = "127.0.0.1"
DEFAULT_KV_PORT = 14579
_ACCEPTED_UNUSED = {
    "kv_rank",
    "kv_parallel_size",
    "kv_buffer_size",
    "kv_buffer_device",
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
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        value = {k: v for k, v in value.items() if k not in _ACCEPTED_UNUSED}
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; known: kv_role, kv_ip, kv_port, kv_connector"
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

    ``do_remote_decode`` (producer): keep the prompt's blocks after the request ends, for a
    consumer to pull as transfer ``request_id``. ``do_remote_prefill`` (consumer): the prompt's
    cache comes from engine ``remote_engine_id``'s transfer ``transfer_id``, computed over
    ``num_prompt_tokens`` tokens (checked against this instance's tokenization).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    transfer_id: str | None = None
    num_prompt_tokens: int | None = None


def request_params(raw: Any, num_prompts: int) -> list[KVTransferParams] | None:
    """A request body's ``kv_transfer_params`` as one ``KVTransferParams`` per prompt (None when
    absent); ValueError naming what is wrong."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("kv_transfer_params must be an object")
    if raw.get("do_remote_decode"):
        return [KVTransferParams(do_remote_decode=True)] * num_prompts
    if not raw.get("do_remote_prefill"):
        return None
    engine_id = raw.get("remote_engine_id")
    ids, counts = raw.get("transfer_ids"), raw.get("num_prompt_tokens")
    if not isinstance(engine_id, str) or not isinstance(ids, list) or not isinstance(counts, list):
        raise ValueError(
            "kv_transfer_params with do_remote_prefill needs remote_engine_id, transfer_ids, num_prompt_tokens"
        )
    if len(ids) != num_prompts or len(counts) != num_prompts:
        raise ValueError(f"kv_transfer_params names {len(ids)} transfers for {num_prompts} prompts")
    if not all(isinstance(t, str) for t in ids) or not all(isinstance(n, int) and n > 0 for n in counts):
        raise ValueError("kv_transfer_params: transfer_ids must be strings and num_prompt_tokens positive integers")
    return [
        KVTransferParams(do_remote_prefill=True, remote_engine_id=engine_id, transfer_id=t, num_prompt_tokens=n)
        for t, n in zip(ids, counts)
    ]
