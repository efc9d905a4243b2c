"""Grammar backends: a constraint compiled once for a tokenizer, a matcher per sequence, and the
token bitmask each step applies to the logits.

    backend = make_backend(tokenizer, vocab_size)   # the one factory
    grammar = backend.compile(params)                # ValueError naming the problem; cached by params.key
    matcher = backend.matcher(grammar)               # per sequence: consume_token(t), is_stopped()
    mask = backend.allocate_bitmask(rows)            # (rows, ceil(V / 32)) int32
    backend.fill_bitmask(matcher, mask, row)         # the tokens that may come next
    kernels.apply_token_bitmask_(logits, mask)       # the step's kernels: disallowed tokens to -inf

Only llguidance ships (``LLGuidanceBackend``). It was picked over xgrammar, measured on the
same tokenizers (``benchmarks/structured.py``): llguidance compiles a schema 5-40x sooner
(0.8 ms against 5.9 ms for a small one, 4.3 ms against 172 ms for a 50-property nested one,
32k vocabulary, AMD EPYC). Its mask fill is slower (4-20 us a row against 1 us), but both are
under 1% of a CPU decode step. It is also one wheel with no dependencies, where xgrammar
requires triton and apache-tvm-ffi besides torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol

import torch

from ridge.structured.params import StructuredOutputsParams

# Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, params: StructuredOutputsParams) -> Any: ...

    def matcher(self, grammar: Any) -> Any: ...

    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...

    def fill_bitmask(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...


def make_backend(tokenizer, vocab_size: int) -> GrammarBackend:
    """The grammar backend for ``tokenizer`` (a ridge tokenizer) over ``vocab_size`` logits."""
    return LLGuidanceBackend(tokenizer, vocab_size)


class _ByteVocabulary:
    """ridge's byte tokenizer as llguidance's ``TokenizerWrapper`` reads a tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [name.encode() for name in tokenizer.SPECIAL_TOKENS] + [bytes([b]) for b in range(256)]
        self.special_token_ids = list(range(tokenizer.OFFSET))
        self._offset = tokenizer.OFFSET

    def __call__(self, text) -> list[int]:
        data = text.encode() if isinstance(text, str) else bytes(text)
        return [b + self._offset for b in data]


class LLGuidanceBackend:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        hf = getattr(tokenizer, "hf_tokenizer", None)
        try:
            if hf is not None:
                self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
            else:
                wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer))
                self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size)
        except Exception as exc:  # a slow (non-fast) tokenizer, an odd vocabulary
            raise ValueError(f"structured output is not available for this tokenizer ({exc})") from None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # constraint key -> template matcher
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The constraint validated against the vocabulary and built into a template matcher
        (cached by the constraint's key); ValueError naming what is wrong with it."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        fmt, text = params.grammar_spec()
        try:
            grammar = self._llguidance.grammar_from(fmt, text)
            is_error, messages = self._llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        except Exception as exc:  # whatever the input, a clear error for this request alone
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(exc)}") from None
        if is_error:
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(messages[0] if messages else 'invalid')}")
        # The matcher every request of this constraint copies: built here, with its first mask,
        # so that a request pays neither (the first mask also warms the vocabulary's caches).
        template = self._llguidance.LLMatcher(self.tokenizer, grammar)
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(template.get_error())}")
        self.fill_bitmask(template, self.allocate_bitmask(1), 0)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, template):
        """A fresh matcher of a compiled constraint (a copy of its template: microseconds)."""
        return template.deep_copy()

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """Words for the model's whole vocabulary: ids past the tokenizer's (padding rows of
        the embedding) are never allowed."""
        import llguidance.torch

        return llguidance.torch.allocate_token_bitmask(rows, max(self.vocab_size, self.tokenizer.vocab_size))

    def fill_bitmask(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        words = -(-self.tokenizer.vocab_size // 32)
        if words == bitmask.shape[1]:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
            return
        # the tokenizer's ids fill the first words; the padding ids stay disallowed
        inner = llguidance.torch.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, inner, 0)
        bitmask[row].zero_()
        bitmask[row, :words] = inner[0]
        tail = self.tokenizer.vocab_size % 32
        if tail:  # bits past the tokenizer's last id in its last word
            bitmask[row, words - 1] &= (1 << tail) - 1


def _first_line(message: object) -> str:
    """llguidance's message on one line (its own lines joined; the grammar's echo left out)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    kept = [line for line in lines if not line[:1].isdigit() or ":" in line[:6]][:6]
    return " ".join(kept)[:400] if kept else str(message)
