"""What a front end (the HTTP server, ``LLM``) may ask of an engine: the whole interface.

    add_request(id, prompt, params, arrival_time=..)   submit (ValueError on bad input)
    step() -> [RequestOutput]                          stream: outputs of the requests that progressed
    abort_request(id)
    has_unfinished_requests()
    stats() -> EngineStats                             state as data (what /metrics renders)
    kv_info() / kv_connect(peer)                       disaggregated serving: identity, pairing
    prepare(params)                                    compile a constraint (any thread; ValueError)

and what it needs to prepare requests: the tokenizer, ``max_model_len`` and
``check_prompt_chars`` (refuse an over-long prompt before tokenizing it). ``LLMEngine``
implements it; nothing on the other side of it reaches an engine attribute.
"""

from __future__ import annotations

from typing import Protocol

from ridge.engine.outputs import RequestOutput
from ridge.engine.stats import EngineStats
from ridge.engine.tokenizer import BaseTokenizer
from ridge.kv_transfer.config import KVTransferParams
from ridge.sampling import SamplingParams


class EngineFatalError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died or hung): every request in flight
    fails, and a server stops taking new ones."""


class EngineClient(Protocol):
    tokenizer: BaseTokenizer
    max_model_len: int

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = True,
        kv_transfer: KVTransferParams | None = None,
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def check_prompt_chars(self, num_chars: int) -> None: ...

    def kv_info(self) -> dict | None: ...

    def prepare(self, params: SamplingParams) -> None: ...

    def set_wakeup(self, callback) -> None: ...

    def kv_connect(self, peer: dict) -> None: ...
