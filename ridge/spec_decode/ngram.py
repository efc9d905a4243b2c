"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, trying n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

Incremental, so a step costs what the new tokens cost, never a scan of the context. For each
n, a table maps every n-gram that is followed by at least one token to where its latest
occurrence's continuation starts:

    tokens:   a b c d a b c ?        (L = 7 tokens, n = 2)
    table:    (a,b)->2 (b,c)->3 (c,d)->4 (d,a)->5 (a,b)->6
    suffix:   (b,c) -> continuation starts at 3: propose d a b c ... (up to k tokens)

The n-gram ending at the last token is indexed only once a token follows it, so the suffix
never finds itself.
"""

from __future__ import annotations


class NgramIndex:
    """The n-gram tables of one sequence (prompt + accepted output; append-only)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.num_indexed = 0  # n-grams ending before this position are in the tables

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram that now has a following token (ends at <= len(tokens) - 2)."""
        for end in range(self.num_indexed, len(tokens) - 1):
            for n, table in self.tables.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix's latest occurrence."""
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.hi, length - 1), self.lo - 1, -1):
            start = self.tables[n].get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []


class NgramProposer:
    """One ``NgramIndex`` per running sequence, dropped when the sequence finishes. Runs no
    model: no pass time (``pass_s``) and no passes for the telemetry (``take_passes``)."""

    pass_s = None
    max_model_len = None
    host_only = True  # a lookup in host tables: cheap enough to try between pipelined steps

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def take_passes(self) -> list:
        return []

    def propose(self, requests, k: int) -> dict[str, tuple[list[int], None]]:
        """Request id -> (up to k proposed tokens, None: no distribution); absent: nothing found."""
        out = {}
        for req in requests:
            index = self._indexes.get(req.req_id)
            if index is None or index.num_indexed > len(req.token_ids):  # a new sequence under a reused id
                index = self._indexes[req.req_id] = NgramIndex(self.lo, self.hi)
            tokens = index.propose(req.token_ids, k)
            if tokens:
                out[req.req_id] = (tokens, None)
        return out

    def forget_except(self, running: set[str]) -> None:
        """Drop the indexes of sequences no longer running (finished, aborted; a preempted
        one keeps its index: its tokens stand)."""
        for rid in [rid for rid in self._indexes if rid not in running]:
            del self._indexes[rid]
