"""The engine's side of structured output: a grammar matcher per constrained sequence, the
step's bitmask (plain data in the plan: one row per constrained sequence that samples), and
the matchers' advance with each accepted token.

The backend (``ridge/structured/backend.py``) is built on the first constrained request (a
tokenizer it cannot read then refuses that request with a clear error). ``compile`` is
thread-safe: a server compiles a request's constraint on a worker thread before it reaches
the engine loop, which then finds it cached. A sequence's tokens stay accepted through a
preemption (it is recomputed, not resampled), so its matcher never rolls back. Speculation:
proposals are cut at the first token the grammar refuses (``vet``), and a verify run is masked
at each position (the matcher consumes the proposals to fill their rows, then rolls back), so
speculation never changes what a constrained sequence may output. ``stats``: compile and mask
times, as data.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ridge.engine.step import SchedulerOutput
from ridge.structured.backend import GrammarBackend, make_backend
from ridge.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class StructuredStats:
    """Structured output since the engine started (plain data: ``/metrics``, ``--stats``)."""

    requests: int = 0  # constrained sequences admitted
    compiles: int = 0  # constraints compiled (cache misses)
    compile_s: float = 0.0
    mask_steps: int = 0  # steps that masked
    mask_rows: int = 0
    mask_s: float = 0.0  # filling the bitmasks (the engine thread)

    def copy(self) -> StructuredStats:
        return StructuredStats(**vars(self))


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._compiled: set[str] = set()  # constraint keys compiled (for the stats)
        self._matchers: dict[str, object] = {}  # sequence id -> matcher
        self.stats = StructuredStats()

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = make_backend(self.tokenizer, self.vocab_size)
            return self._backend

    def compile(self, params: StructuredOutputsParams):
        """The compiled constraint (cached); ValueError naming what is wrong with it. Any thread."""
        start = time.perf_counter()
        grammar = self.backend.compile(params)
        with self._lock:
            if params.key not in self._compiled:
                self._compiled.add(params.key)
                self.stats.compiles += 1
                self.stats.compile_s += time.perf_counter() - start
        return grammar

    def add(self, seq_id: str, grammar) -> None:
        self._matchers[seq_id] = self.backend.matcher(grammar)
        self.stats.requests += 1

    def constrained(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def fill_plan(self, plan: SchedulerOutput) -> float:
        """One bitmask row per constrained chunk that samples this step; returns the seconds spent."""
        if not self._matchers:  # the usual step: nothing constrained
            return 0.0
        chunks = [c for c in plan.chunks if c.samples and c.req_id in self._matchers]
        if not chunks:
            return 0.0
        start = time.perf_counter()
        bitmask = self.backend.allocate_bitmask(sum(1 + len(c.draft_token_ids) for c in chunks))
        row = 0
        for c in chunks:
            matcher = self._matchers[c.req_id]
            plan.grammar_rows[c.req_id] = row
            # a verify run: the grammar's state before each proposed token (consumed, then rolled back)
            consumed = 0
            for j in range(1 + len(c.draft_token_ids)):
                if j == consumed:
                    self.backend.fill_bitmask(matcher, bitmask, row + j)
                else:  # past a refused proposal (its row rejects it): any allowed row will do
                    bitmask[row + j] = bitmask[row + consumed]
                if j < len(c.draft_token_ids) and j == consumed and matcher.consume_token(c.draft_token_ids[j]):
                    consumed += 1
            if consumed:
                matcher.rollback(consumed)
            row += 1 + len(c.draft_token_ids)
        plan.grammar_bitmask = bitmask
        self.stats.mask_steps += 1
        self.stats.mask_rows += row
        elapsed = time.perf_counter() - start
        self.stats.mask_s += elapsed
        return elapsed

    def vet(self, seq_id: str, tokens: list[int]) -> int:
        """How many of a constrained sequence's proposed tokens its grammar accepts in a row
        (all of them for an unconstrained one)."""
        matcher = self._matchers.get(seq_id)
        return len(tokens) if matcher is None else matcher.validate_tokens(tokens)

    def accept(self, accepted: dict[str, list[int]]) -> None:
        """Advance each constrained sequence's matcher over the tokens that stand."""
        if not self._matchers:
            return
        for seq_id, tokens in accepted.items():
            matcher = self._matchers.get(seq_id)
            if matcher is None:
                continue
            for token in tokens:
                if matcher.is_stopped():
                    break
                if not matcher.consume_token(token):
                    logger.warning("structured output: sequence %s took token %d its grammar refuses", seq_id, token)
                    break
