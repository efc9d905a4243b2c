"""The bridge between one engine (not thread-safe) and asyncio request handlers.

One thread, the *engine loop*, owns the engine: it alone calls ``add_request``, ``step``,
``abort_request`` and ``stats`` (the whole ``EngineClient`` interface the server uses).
Handlers on the event loop talk to it through a thread-safe command queue and get outputs
back through ``loop.call_soon_threadsafe`` into a per-group asyncio queue, so the event loop
never waits on a model step.

    handler --add(group)--> [command queue] --> engine loop: add_request / step / abort
    handler <--outputs----- [group's asyncio.Queue] <-- call_soon_threadsafe (once per step)

A *group* is the engine requests of one HTTP request (a completions call may carry several
prompts). Contracts:

* ``await add_group(...)`` returns only once the engine loop has queued every request of the
  group, or raises the ``ValueError`` that ``add_request`` raised (nothing of the group is
  left in the engine, and no other request is disturbed).
* Iterating an ``OutputStream`` yields ``(index, RequestOutput)`` until every request of the
  group has finished; an engine failure or shutdown is raised from the iteration.
* ``OutputStream.abort()`` (idempotent, safe from the event loop) aborts what has not
  finished; the engine frees its KV blocks when the loop processes the command, before the
  next step.
* ``await stats()`` is the engine's ``EngineStats``, taken between two steps; ``await
  kv_info()`` and ``await kv_connect(peer)`` run on the engine thread too (disaggregated
  serving: identity, pairing with a peer).
* A request that fails on its own (its KV transfer from a producer failed) raises its error
  from its group's iteration; the group's other requests are aborted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ridge.engine.client import EngineClient, EngineFatalError
from ridge.engine.outputs import RequestOutput
from ridge.engine.stats import EngineStats
from ridge.kv_transfer.config import KVTransferParams
from ridge.sampling import SamplingParams

logger = logging.getLogger("ridge.server")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shutdown) or failed; the request cannot be served."""


class EngineObserver:
    """What the engine loop reports, on the engine thread (override what you need).

    ``on_step`` runs after every step with the outputs it produced and the step's start and
    end (monotonic seconds); ``on_abort`` with ``(request_id, n)`` for each request aborted
    before it finished (``n``: its sequences).
    """

    def on_step(self, outputs: list[RequestOutput], start: float, end: float) -> None:
        pass

    def on_abort(self, aborted: Sequence[tuple[str, int]]) -> None:
        pass


# -- the asyncio side --------------------------------------------------------------------------

_ACCEPTED = object()  # the engine loop's "all requests of the group are queued"


class OutputStream:
    """The outputs of one group of engine requests, as ``(index, RequestOutput)``."""

    def __init__(self, owner: AsyncEngine, request_ids: list[str], loop: asyncio.AbstractEventLoop) -> None:
        self._owner = owner
        self.request_ids = request_ids
        self.loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._aborted = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: Any) -> None:  # on the event loop
        self._queue.put_nowait(item)

    async def _wait_accepted(self) -> None:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            index, output = item
            if output.finished:
                self._unfinished.discard(index)
            yield index, output

    def abort(self) -> None:
        """Abort every request of the group that has not finished (no-op once finished)."""
        if self._unfinished and not self._aborted:
            self._aborted = True
            self._owner._send(("abort", [self.request_ids[i] for i in sorted(self._unfinished)]))


# -- the engine loop ---------------------------------------------------------------------------


@dataclass
class _Group:
    stream: OutputStream
    prompts: list[str | list[int]]
    params: SamplingParams
    arrival_time: float
    kv_transfer: list[KVTransferParams] | None = None  # one per prompt


class AsyncEngine:
    """Runs ``engine`` on its own thread; see the module docstring for the contracts."""

    def __init__(self, engine: EngineClient, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer or EngineObserver()
        # called once (on the engine thread) when the engine fails for good: ``ridge serve`` exits
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead: BaseException | None = None
        # Engine-thread state: request id -> (group, index in the group).
        self._owner_of: dict[str, tuple[_Group, int]] = {}
        self._poll = False  # the engine asked for a step while idle (set_wakeup)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="ridge-engine-loop", daemon=True)
        self.engine.set_wakeup(lambda: self._commands.put(("poll", None)))
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after the step in progress; pending requests fail with EngineDeadError."""
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.0f s", timeout)
        else:
            self._drain_after_stop()  # commands that raced the loop's exit

    @property
    def is_alive(self) -> bool:
        return (
            self._thread is not None and self._thread.is_alive() and self._dead is None and not self._stopping.is_set()
        )

    @property
    def error(self) -> BaseException | None:
        return self._dead

    # -- the asyncio API ----------------------------------------------------------------
    async def add_group(
        self,
        request_ids: list[str],
        prompts: list[str | list[int]],
        params: SamplingParams,
        arrival_time: float | None = None,
        kv_transfer: list[KVTransferParams] | None = None,
    ) -> OutputStream:
        """Queue one engine request per prompt (all with ``params``; ``kv_transfer``: each
        prompt's part in a KV transfer); see the module docstring."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")
        loop = asyncio.get_running_loop()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.structured_outputs is not None:  # compiled here, off the engine loop
            await loop.run_in_executor(None, self.engine.prepare, params)
        stream = OutputStream(self, list(request_ids), loop)
        self._send(("add", _Group(stream, list(prompts), params, arrival, kv_transfer)))
        await self._wait_accepted_or_abort(stream)
        return stream

    async def _wait_accepted_or_abort(self, stream: OutputStream) -> None:
        try:
            await stream._wait_accepted()
        except asyncio.CancelledError:
            # The handler went away while the add was queued: the add may still land.
            self._send(("abort", stream.request_ids))
            raise

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_prompt_chars(self, num_chars: int) -> None:
        """ValueError when a prompt this long cannot fit the context (reads only fixed sizes)."""
        self.engine.check_prompt_chars(num_chars)

    async def stats(self) -> EngineStats:
        """The engine's state, taken on the engine thread between steps."""
        return await asyncio.wrap_future(self.stats_threadsafe())

    def stats_threadsafe(self) -> concurrent.futures.Future:
        """``stats()`` from any thread: a ``concurrent.futures.Future`` of an ``EngineStats``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_alive:
            future.set_exception(EngineDeadError("the engine is not running"))
            return future
        self._send(("stats", future))
        return future

    async def kv_info(self) -> dict | None:
        """The engine's KV-transfer identity (None: no --kv-transfer-config)."""
        return await self._on_engine_thread(lambda engine: engine.kv_info())

    async def kv_connect(self, peer: dict) -> None:
        """Pair with a peer instance; ValueError when it cannot."""
        await self._on_engine_thread(lambda engine: engine.kv_connect(peer))

    async def _on_engine_thread(self, fn: Callable[[EngineClient], Any]) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        self._send(("call", (fn, future)))
        return await asyncio.wrap_future(future)

    def _send(self, command: tuple[str, Any]) -> None:
        self._commands.put(command)

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                # Block only when idle: with work in flight, take what is queued and step.
                self._process_commands(block=not engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if engine.has_unfinished_requests() or self._poll:
                    self._poll = False
                    self._step()
        except BaseException as exc:  # a bug in the loop itself: fail everyone, loudly
            logger.exception("the engine loop crashed")
            self._dead = exc
        finally:
            self._fail_all(self._dead or EngineDeadError("the server is shutting down"))
            self._drain_after_stop()

    def _process_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=None) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._add(payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "stats":
            future = payload
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.engine.stats())
                except BaseException as exc:
                    future.set_exception(exc)
        elif kind == "poll":
            self._poll = True
        elif kind == "call":
            fn, future = payload
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:
                    future.set_exception(exc)

    def _add(self, group: _Group) -> None:
        stream = group.stream
        added: list[str] = []
        try:
            for i, (request_id, prompt) in enumerate(zip(stream.request_ids, group.prompts)):
                kv = group.kv_transfer[i] if group.kv_transfer is not None else None
                if kv is None:
                    self.engine.add_request(request_id, prompt, group.params, arrival_time=group.arrival_time)
                else:
                    self.engine.add_request(
                        request_id, prompt, group.params, arrival_time=group.arrival_time, kv_transfer=kv
                    )
                added.append(request_id)
        except Exception as exc:  # ValueError: bad input; anything else: reported, not fatal
            for request_id in added:
                self.engine.abort_request(request_id)
            if len(group.prompts) > 1 and isinstance(exc, ValueError):
                exc = ValueError(f"prompt {len(added)}: {exc}")
            self._deliver({stream.loop: [(stream, exc)]})
            return
        for index, request_id in enumerate(added):
            self._owner_of[request_id] = (group, index)
        self._deliver({stream.loop: [(stream, _ACCEPTED)]})

    def _abort(self, request_ids: list[str]) -> None:
        aborted = []
        for request_id in request_ids:
            owner = self._owner_of.pop(request_id, None)
            if owner is None:
                continue  # finished already, or its add failed
            self.engine.abort_request(request_id)
            aborted.append((request_id, owner[0].params.n))
        if aborted:
            self.observer.on_abort(aborted)

    def _step(self) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except EngineFatalError as exc:
            # A rank died or hung: nothing can run any more. Every request in flight fails,
            # new ones get 503, and the loop ends.
            logger.error("the engine failed: %s", exc)
            self._dead = exc
            self._stopping.set()
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        except Exception as exc:
            # A failed step leaves its requests in an unknown state: fail and abort them all,
            # which frees their blocks, and keep serving new requests.
            logger.exception("engine step failed; aborting the requests in flight")
            self._fail_all(RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        end = time.monotonic()
        self.observer.on_step(outputs, start, end)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        failed: list[_Group] = []
        for output in outputs:
            owner = self._owner_of.get(output.request_id)
            if owner is None:
                continue
            group, index = owner
            if output.finished or output.error is not None:
                del self._owner_of[output.request_id]
            if output.error is not None:
                failed.append(group)
                batches.setdefault(group.stream.loop, []).append((group.stream, RuntimeError(output.error)))
                continue
            batches.setdefault(group.stream.loop, []).append((group.stream, (index, output)))
        for group in failed:  # the group's other requests end with it
            self._abort([rid for rid in group.stream.request_ids if rid in self._owner_of])
        self._deliver(batches)

    def _deliver(self, batches: dict[asyncio.AbstractEventLoop, list]) -> None:
        """One ``call_soon_threadsafe`` per event loop per step, not one per output."""
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody will read these
                for stream, _ in items:
                    self._abort(list(stream.request_ids))

    def _fail_all(self, exc: BaseException) -> None:
        groups = {id(g): g for g, _ in self._owner_of.values()}.values()
        aborted = [(request_id, group.params.n) for request_id, (group, _) in self._owner_of.items()]
        for request_id, _ in aborted:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be broken; the requests fail anyway
                logger.exception("could not abort %s", request_id)
        self._owner_of.clear()
        if aborted:
            self.observer.on_abort(aborted)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for group in groups:
            batches.setdefault(group.stream.loop, []).append((group.stream, exc))
        self._deliver(batches)

    def _drain_after_stop(self) -> None:
        """Answer commands that arrived after the loop stopped, so no handler waits forever."""
        dead = self._dead or EngineDeadError("the server is shutting down")
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._deliver({payload.stream.loop: [(payload.stream, dead)]})
            elif kind == "stats":
                payload.set_exception(dead)
            elif kind == "call":
                payload[1].set_exception(dead)


def _put_all(items: list) -> None:
    for stream, item in items:
        stream._put(item)
