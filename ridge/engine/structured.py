"""The engine's side of structured output: a grammar matcher per constrained sequence, the
step's bitmask (plain data in the plan: one row per constrained sequence that samples), and
the matchers' advance with each accepted token.

The backend (``ridge/structured/backend.py``) is built on the first constrained request (a
tokenizer it cannot read then refuses that request with a clear error). A sequence's tokens
stay accepted through a preemption (it is recomputed, not resampled), so its matcher never
rolls back. Constrained sequences are not speculated for.
"""

from __future__ import annotations

import logging

from ridge.engine.step import SchedulerOutput
from ridge.structured.backend import GrammarBackend, make_backend
from ridge.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._matchers: dict[str, object] = {}  # sequence id -> matcher

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = make_backend(self.tokenizer, self.vocab_size)
        return self._backend

    def compile(self, params: StructuredOutputsParams):
        """The compiled constraint (cached); ValueError naming what is wrong with it."""
        return self.backend.compile(params)

    def add(self, seq_id: str, grammar) -> None:
        self._matchers[seq_id] = self.backend.matcher(grammar)

    def constrained(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def fill_plan(self, plan: SchedulerOutput) -> None:
        """One bitmask row per constrained chunk that samples this step."""
        rows = [c.req_id for c in plan.chunks if c.samples and c.req_id in self._matchers]
        if not rows:
            return
        bitmask = self.backend.allocate_bitmask(len(rows))
        for row, seq_id in enumerate(rows):
            self.backend.fill_bitmask(self._matchers[seq_id], bitmask, row)
        plan.grammar_bitmask = bitmask
        plan.grammar_rows = {seq_id: row for row, seq_id in enumerate(rows)}

    def accept(self, accepted: dict[str, list[int]]) -> None:
        """Advance each constrained sequence's matcher over the tokens that stand."""
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
