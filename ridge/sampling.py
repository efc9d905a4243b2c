"""Sampling: request parameters, per-request state, and the batched sampler.

``SamplingParams`` mirrors vLLM's fields, defaults and semantics, and validates itself.
``SamplingState`` is what the engine keeps per admitted request; ``Sampler`` turns a batch of
logits into one token per row.

The sampler works in this order (vLLM v1's):

1. logprobs (when asked) are taken from the *raw* model distribution: ``log_softmax`` of the
   fp32 logits before any penalty, temperature or truncation;
2. repetition / frequency / presence penalties;
3. the ``min_tokens`` mask (stop and eos ids are forbidden until enough tokens are out);
4. greedy rows (temperature 0) take the argmax here;
5. the other rows: divide by temperature, then mask with min_p, top_k and top_p, then sample.

Sampling uses the exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d., which picks
token ``i`` with probability ``probs[i]``. A seeded request draws its ``q`` from its own
generator over its own row only, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

# vLLM's cap on the number of top logprobs a request may ask for.
MAX_LOGPROBS = 20
# vLLM clamps 0 < temperature < 0.01 up to 0.01: smaller values make logits / T overflow.
MIN_TEMPERATURE = 1e-2
# torch.Generator.manual_seed accepts seeds in [-2**63, 2**64).
_SEED_RANGE = (-(2**63), 2**64 - 1)
# seed=-1 asks for a random seed (llama.cpp's convention, which its users expect).
RANDOM_SEED = -1


# ----------------------------------------------------------------------------------------------
# Validation helpers (pure functions; each returns the normalized value or raises ValueError).


def _check_int(
    name: str, value: object, *, lo: int | None = None, hi: int | None = None, allow_none: bool = False, rule: str
) -> int | None:
    if value is None and allow_none:
        return None
    # bool is an int subclass, but True as a count is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {rule}, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an int {rule}, got {value}")
    return value


def _check_float(name: str, value: object, *, ok: Callable[[float], bool], rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a float {rule}, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be a float {rule}, got {value}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's ``SamplingParams`` fields and defaults).

    Validated and normalized at construction; every bad value raises ``ValueError`` naming the
    field and its allowed range. Treat an instance as read-only afterwards (use
    ``dataclasses.replace`` to derive a changed copy; it re-validates).

    Normalizations: ``stop`` becomes a list of non-empty strings (``None`` -> ``[]``),
    ``stop_token_ids`` a list of ints (``None`` -> ``[]``), ``top_k=0`` becomes ``-1``
    (disabled), ints given for float fields become floats, and ``0 < temperature < 0.01`` is
    raised to 0.01 with a warning (as vLLM does, to keep ``logits / T`` finite).
    ``seed=-1`` means random, as in llama.cpp (it becomes ``None``); other seeds are kept
    modulo 2**64, which is how ``torch.Generator.manual_seed`` reads them.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = disabled
    top_k: int = -1  # -1 (or 0) = disabled
    min_p: float = 0.0  # [0, 1]; 0 = disabled
    repetition_penalty: float = 1.0  # > 0; 1 = disabled
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the model's context limit
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = sampled token's logprob + top-k
    # None = none; k = each prompt token's logprob (raw distribution) + the top-k at its
    # position; the first prompt token has none. Such a request is not served from the
    # prefix cache (every prompt position must be computed).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: the output's shape (a JSON schema, any JSON object, a regex, a choice or a
    # grammar), enforced token by token; a ``StructuredOutputsParams`` or a dict of its fields
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        from ridge.structured.params import StructuredOutputsParams

        self.structured_outputs = StructuredOutputsParams.parse(self.structured_outputs)
        self.n = _check_int("n", self.n, lo=1, rule=">= 1")
        self.temperature = _check_float("temperature", self.temperature, ok=lambda v: v >= 0, rule=">= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(
                f"temperature {self.temperature} is below {MIN_TEMPERATURE}, which risks inf/nan "
                f"in logits / temperature; using {MIN_TEMPERATURE}",
                stacklevel=3,
            )
            self.temperature = MIN_TEMPERATURE
        self.top_p = _check_float("top_p", self.top_p, ok=lambda v: 0 < v <= 1, rule="in (0, 1]")
        self.top_k = _check_int("top_k", self.top_k, lo=-1, rule=">= 1, or -1 / 0 to disable")
        if self.top_k == 0:
            self.top_k = -1
        self.min_p = _check_float("min_p", self.min_p, ok=lambda v: 0 <= v <= 1, rule="in [0, 1]")
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, ok=lambda v: v > 0, rule="> 0"
        )
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _check_float(name, getattr(self, name), ok=lambda v: -2 <= v <= 2, rule="in [-2, 2]"))
        self.seed = _check_int(
            "seed",
            self.seed,
            lo=_SEED_RANGE[0],
            hi=_SEED_RANGE[1],
            allow_none=True,
            rule="in [-2**63, 2**64), -1 (random) or None",
        )
        if self.seed == RANDOM_SEED:
            self.seed = None
        elif self.seed is not None:
            self.seed %= 2**64  # manual_seed's own reading of a negative seed
        self.max_tokens = _check_int("max_tokens", self.max_tokens, lo=1, allow_none=True, rule=">= 1 or None")
        self.min_tokens = _check_int("min_tokens", self.min_tokens, lo=0, rule=">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = _check_int(
                name,
                getattr(self, name),
                lo=0,
                hi=MAX_LOGPROBS,
                allow_none=True,
                rule=f"in [0, {MAX_LOGPROBS}] or None",
            )
            setattr(self, name, value)

    @staticmethod
    def _normalize_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a str, a list of non-empty str, or None, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold only non-empty strings, got {s!r}")
        return list(stop)

    @staticmethod
    def _normalize_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0 or None, got {type(ids).__name__}")
        return [_check_int("stop_token_ids[]", t, lo=0, rule=">= 0") for t in ids]

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: with a seed, each sample its own stream,
        reproducibly (seed + index, wrapping at 2**64); without one, these params."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + index) % 2**64)

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature == 0): argmax, no randomness."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition / presence / frequency penalties is active."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# ----------------------------------------------------------------------------------------------
# Per-request state.


@dataclass
class SamplingState:
    """What the sampler needs to know about one running request.

    Contract with the engine: ``prompt_token_ids`` does not change after creation (the sampler
    caches a device copy of it for the repetition penalty); the engine appends every sampled
    token to ``output_token_ids`` (the same list object) before the next step.

    ``eos_token_ids`` are, together with ``params.stop_token_ids``, forbidden while
    ``len(output_token_ids) < params.min_tokens`` -- except that with ``params.ignore_eos`` eos
    is not a stop token and so is not masked (vLLM's behaviour).

    ``generator``: leave ``None``; when ``params.seed`` is set the sampler builds it from the
    seed on the logits' device at the first step (see ``generator_for``). A generator passed in
    explicitly is used as-is. A request with neither uses the sampler's own generator.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    # ((device, vocab size), distinct prompt ids): built on first use by the repetition penalty.
    _prompt_cache: tuple[tuple[torch.device, int], torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        self.eos_token_ids = frozenset(self.eos_token_ids)

    @property
    def seeded(self) -> bool:
        """True when this request samples from its own generator (a seed or a given one)."""
        return self.generator is not None or self.params.seed is not None

    def generator_for(self, device: torch.device) -> torch.Generator:
        """This request's generator on ``device``, built from ``params.seed`` on first use.

        Raises ValueError if the request already has a generator on another device: silently
        re-seeding would replay the random stream from the start.
        """
        if self.generator is None:
            if self.params.seed is None:
                raise ValueError("generator_for needs params.seed or an explicit generator")
            self.generator = torch.Generator(device=device).manual_seed(self.params.seed)
        elif self.generator.device != device:
            from ridge.config import indexed_device  # a generator made on 'cuda' reports 'cuda'

            if indexed_device(self.generator.device) != indexed_device(device):
                raise ValueError(f"request generator lives on {self.generator.device}, logits on {device}")
        return self.generator

    def prompt_ids_tensor(self, device: torch.device, vocab_size: int) -> torch.Tensor:
        """The distinct prompt token ids in ``[0, vocab_size)``, int64 on ``device`` (cached)."""
        key = (device, vocab_size)
        if self._prompt_cache is None or self._prompt_cache[0] != key:
            ids = torch.tensor(self.prompt_token_ids, dtype=torch.long).unique()
            ids = ids[(ids >= 0) & (ids < vocab_size)]
            self._prompt_cache = (key, ids.to(device))
        return self._prompt_cache[1]

    def min_tokens_active(self) -> bool:
        """True while stop / eos ids must still be masked."""
        return len(self.output_token_ids) < self.params.min_tokens

    def plain_greedy(self) -> bool:
        """Whether the row's token is its logits' argmax and nothing else is asked of it: greedy,
        no logprobs, no penalties, no min_tokens holding EOS back. The sampler's fast path (one
        argmax for a batch of them), the verification of plain-greedy draft runs together, and
        the decode plan's greedy passes (which compute exactly that argmax) take such rows."""
        p = self.params
        return p.greedy and p.logprobs is None and not p.has_penalties and not self.min_tokens_active()


@dataclass
class SamplerOutput:
    """One sampling step's result, one entry per batch row, in row order.

    ``logprobs[i]`` is the sampled token's log-probability under the raw model distribution
    (``None`` when the row's ``params.logprobs`` is ``None``). ``top_logprobs[i]`` is the row's
    top-``params.logprobs`` ``(token_id, logprob)`` pairs, best first (``[]`` for k = 0,
    ``None`` when not asked).
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


# ----------------------------------------------------------------------------------------------
# Batched logits transforms (pure tensor functions, in place; exposed for testing).


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf, in place) tokens whose prob is < ``min_p * max prob`` of their row.

    ``logits``: (R, V) fp32; ``min_p``: (R,) in [0, 1] (0 leaves the row unchanged). The most
    likely token always survives since ``min_p <= 1``. Returns ``logits``.
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf, in place) tokens outside each row's top-k, then outside its top-p nucleus.

    ``logits``: (R, V) fp32. ``top_k``: (R,) int64, a row's k (``>= V`` = disabled), or None.
    ``top_p``: (R,) float in (0, 1] (1 = disabled), or None.

    top-k keeps every token >= the k-th largest logit (ties at the boundary are all kept, as in
    vLLM and HF). top-p then keeps, from the top-k-renormalized distribution, the smallest set of
    most-likely tokens whose mass reaches p; the most likely token always survives. Returns
    ``logits``.
    """
    if top_k is None and top_p is None:
        return logits
    neg_inf = float("-inf")
    vocab = logits.shape[-1]
    if top_p is None:
        # top-k alone: a partial topk is much cheaper than the full sort top-p needs.
        disabled = top_k >= vocab
        k = top_k.clamp(1, vocab).masked_fill(disabled, 1)
        max_k = int(k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        kth.masked_fill_(disabled.unsqueeze(1), neg_inf)
        return logits.masked_fill_(logits < kth, neg_inf)

    # Ascending and stable, so ties resolve the same way whatever the batch around a row.
    sorted_logits, order = logits.sort(dim=-1, stable=True)
    if top_k is not None:
        k = top_k.clamp(1, vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, neg_inf)
    # A token is dropped when the mass at or below it is <= 1 - p, i.e. when the tokens above
    # it already reach p. The last (most likely) token is always kept.
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, neg_inf)
    return logits.scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Apply each row's repetition / presence / frequency penalties to ``logits`` in place.

    ``logits``: (B, V) fp32, one row per state. Repetition (HF/vLLM): every token id seen in
    prompt + output gets ``logit / p`` when the logit is > 0, else ``logit * p``. Then presence
    and frequency (OpenAI), over output tokens only: ``logit -= frequency * count`` and
    ``logit -= presence * (count > 0)``. Token ids outside ``[0, V)`` are ignored. Returns
    ``logits``.

    Sparse: only the (row, token) positions that occur are read and written, so the cost scales
    with the number of prompt + output tokens of penalized rows, not with B * V. Each update is
    gather -> compute -> scatter, where duplicate positions compute and write the same value.
    """
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    sub = [states[i] for i in rows]
    # Per-row parameters in one host->device copy; column 3 is the row's batch index.
    table = torch.tensor(
        [
            (s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty, i)
            for i, s in zip(rows, sub)
        ],
        dtype=torch.float64,
    ).to(device)
    rep, presence, frequency = (table[:, j].to(torch.float32) for j in range(3))
    batch_row = table[:, 3].long()

    # Every output occurrence as (index into sub, token id).
    out_ids = torch.tensor(list(itertools.chain.from_iterable(s.output_token_ids for s in sub)), dtype=torch.long).to(
        device
    )
    out_sub = torch.repeat_interleave(torch.arange(len(sub)), torch.tensor([len(s.output_token_ids) for s in sub])).to(
        device
    )
    valid = (out_ids >= 0) & (out_ids < vocab)
    out_ids, out_sub = out_ids[valid], out_sub[valid]

    if any(s.params.repetition_penalty != 1.0 for s in sub):
        prompt = [s.prompt_ids_tensor(device, vocab) for s in sub]
        p_sub = torch.repeat_interleave(torch.arange(len(sub)), torch.tensor([len(t) for t in prompt])).to(device)
        sub_idx = torch.cat([p_sub, out_sub])
        r, t = batch_row[sub_idx], torch.cat([*prompt, out_ids])
        v, factor = logits[r, t], rep[sub_idx]
        logits[r, t] = torch.where(v > 0, v / factor, v * factor)

    if out_ids.numel() and any(s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0 for s in sub):
        # Occurrences of each (row, token): equal-range width in the sorted keys (exact, no sync).
        keys = out_sub * vocab + out_ids
        sorted_keys = keys.sort().values
        counts = (torch.searchsorted(sorted_keys, keys, right=True) - torch.searchsorted(sorted_keys, keys)).to(
            torch.float32
        )
        r = batch_row[out_sub]
        v = logits[r, out_ids] - frequency[out_sub] * counts
        logits[r, out_ids] = v - presence[out_sub]
    return logits


def apply_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Forbid (-inf, in place) stop and eos token ids in rows that have not reached min_tokens.

    eos is left alone when ``params.ignore_eos`` is set (it is then not a stop token). Ids
    outside ``[0, V)`` are ignored. Returns ``logits``.
    """
    vocab = logits.shape[-1]
    rows: list[int] = []
    ids: list[int] = []
    for i, s in enumerate(states):
        if not s.min_tokens_active():
            continue
        banned = set(s.params.stop_token_ids)
        if not s.params.ignore_eos:
            banned |= s.eos_token_ids
        for t in banned:
            if 0 <= t < vocab:
                rows.append(i)
                ids.append(t)
    if rows:
        index = torch.tensor([rows, ids], dtype=torch.long).to(logits.device)
        logits[index[0], index[1]] = float("-inf")
    return logits


# ----------------------------------------------------------------------------------------------
# The sampler.


class Sampler:
    """Turns a (B, V) batch of logits into one token per row; see the module docstring.

    Owns one ``torch.Generator`` per device (seeded with ``seed``) for unseeded requests, so it
    never touches torch's global RNG state. Seeded requests use their own generators only.
    """

    def __init__(self, seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``argmax``: (R, V) logits -> (R,) int64 index of each row's largest value, the first
        of equal maxima: the model's kernels' (``TorchKernels.argmax``, or the CPU kernel that
        replaces torch's ~0.1 ms a 32k-token row); torch's own by default."""
        self._seed = _check_int("seed", seed, lo=_SEED_RANGE[0], hi=_SEED_RANGE[1], rule="in [-2**63, 2**64)")
        self._generators: dict[torch.device, torch.Generator] = {}
        self.argmax = argmax if argmax is not None else partial(torch.argmax, dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample one token per row.

        ``logits``: (B, V), any float dtype, one row per state in order; not modified.
        Reads (never writes) ``states[i].output_token_ids``; the caller appends the result.
        """
        return self.launch(logits, states).result()

    def launch(self, logits: torch.Tensor, states: list[SamplingState]) -> PendingSample:
        """``__call__`` without its wait: every kernel enqueued (on a GPU the host does not wait
        for them), the tokens a device tensor; ``result()`` brings them and the logprobs back."""
        batch = len(states)
        if logits.dim() != 2 or logits.shape[0] != batch or logits.shape[1] == 0 or not logits.is_floating_point():
            raise ValueError(
                f"logits must be a float (B, V) tensor with B = len(states) = {batch}, V >= 1; "
                f"got {tuple(logits.shape)} {logits.dtype}"
            )
        if batch == 0:
            return PendingSample(torch.empty(0, dtype=torch.long, device=logits.device), batch)

        # Fast path: plain greedy everywhere is a single argmax, no copies, no per-row tensors.
        if all(s.plain_greedy() for s in states):
            return PendingSample(self.argmax(logits), batch)

        device = logits.device
        x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        greedy_rows, sample_rows, lp_rows = [], [], []
        for i, s in enumerate(states):
            (greedy_rows if s.params.greedy else sample_rows).append(i)
            if s.params.logprobs is not None:
                lp_rows.append(i)

        # Raw-distribution logprobs, taken before any in-place edit of x.
        raw_logprobs = None
        if lp_rows:
            raw_logprobs = torch.log_softmax(
                x if len(lp_rows) == batch else x[torch.tensor(lp_rows, device=device)], dim=-1
            )

        apply_penalties(x, states)
        apply_min_tokens(x, states)

        if not sample_rows:
            tokens = self.argmax(x)
        elif not greedy_rows:
            tokens = self._sample(x, states)
        else:
            tokens = torch.empty(batch, dtype=torch.long, device=device)
            g_idx = torch.tensor(greedy_rows, device=device)
            s_idx = torch.tensor(sample_rows, device=device)
            tokens[g_idx] = self.argmax(x[g_idx])
            tokens[s_idx] = self._sample(x[s_idx], [states[i] for i in sample_rows])
        if raw_logprobs is None:
            return PendingSample(tokens, batch)
        return PendingSample(tokens, batch, *self._logprobs(raw_logprobs, tokens, lp_rows, states))

    def _sample(self, x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Sample from the non-greedy rows ``x`` (R, V) fp32, modified in place."""
        return self.draw(self.probabilities(x, states), states)

    def draw(self, probs: torch.Tensor, states: list[SamplingState] | None) -> torch.Tensor:
        """One token per row of ``probs`` (R, V, unnormalized is fine), from each row's
        generator, or the sampler's own for ``states`` None (modifies probs)."""
        if states is None:
            q = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
            q.clamp_min_(torch.finfo(q.dtype).tiny)
        else:
            q = self._exponentials(probs, states)
        return probs.div_(q).argmax(dim=-1)

    def uniforms(self, count: int, state: SamplingState, device: torch.device) -> list[float]:
        """``count`` U[0, 1) draws from the request's generator (the sampler's when unseeded)."""
        gen = state.generator_for(device) if state.seeded else self._generator(device)
        return torch.rand(count, generator=gen, device=device).tolist()

    def probabilities(self, x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """The distribution each non-greedy row samples from: temperature, min-p, top-k and
        top-p applied to the (penalized) logits ``x`` (R, V) fp32, in place, then softmax."""
        rows, vocab = x.shape
        device = x.device
        params = [s.params for s in states]
        # All per-row parameters in one host->device copy (k <= 2**24 is exact in fp32).
        table = torch.tensor(
            [(p.temperature, p.min_p, p.top_p, p.top_k if 0 < p.top_k < vocab else vocab) for p in params],
            dtype=torch.float32,
        ).to(device)
        x.div_(table[:, 0].unsqueeze(1))
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(x, table[:, 1])
        use_k = any(0 < p.top_k < vocab for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        apply_top_k_top_p(x, table[:, 3].long() if use_k else None, table[:, 2] if use_p else None)
        return x.softmax(dim=-1)

    def _exponentials(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """i.i.d. Exp(1) noise shaped like ``probs``; seeded rows draw from their own generator.

        A seeded row always draws exactly V values from its generator, whatever the batch, which
        is what makes its token stream independent of its neighbours.
        """
        device = probs.device
        seeded = [i for i, s in enumerate(states) if s.seeded]
        if not seeded:
            q = torch.empty_like(probs).exponential_(generator=self._generator(device))
        else:
            q = torch.empty_like(probs)
            for i in seeded:
                q[i].exponential_(generator=states[i].generator_for(device))
            if len(seeded) < len(states):
                unseeded = [i for i, s in enumerate(states) if not s.seeded]
                noise = torch.empty((len(unseeded), probs.shape[1]), device=device)
                noise.exponential_(generator=self._generator(device))
                q.index_copy_(0, torch.tensor(unseeded, device=device), noise)
        # An exact 0 would turn a masked token's 0 / q into nan, which argmax picks.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, lp_rows: list[int], states: list[SamplingState]
    ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The rows that asked, their k, and (as device tensors) the sampled token's logprob
        and the top max-k logprobs with their ids."""
        index = tokens if len(lp_rows) == len(states) else tokens[torch.tensor(lp_rows, device=raw.device)]
        sampled = raw.gather(1, index.unsqueeze(1)).squeeze(1)
        ks = [states[i].params.logprobs for i in lp_rows]
        max_k = min(max(ks), raw.shape[1])
        values, indices = raw.topk(max_k, dim=-1) if max_k > 0 else (None, None)
        return lp_rows, ks, sampled, values, indices


@dataclass
class PendingSample:
    """A launched sampling step (``Sampler.launch``): the tokens as a device tensor, and for
    the rows that asked for logprobs their device tensors; ``result()`` waits for them.

    On CUDA the launch also enqueues their copies into pinned host memory, and an event after
    them: ``result()`` waits for that event, not for the stream, so a step launched meanwhile
    (asynchronous scheduling) runs on while the host reads this one's tokens. (A plain
    ``tolist()`` would wait for everything queued on the stream, the next step's forward too.)"""

    tokens: torch.Tensor
    batch: int
    lp_rows: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    sampled_logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    _host: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # pinned copies (CUDA)
    _ready: torch.cuda.Event | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens.is_cuda:
            return
        for name in ("tokens", "sampled_logprobs", "top_values", "top_ids"):
            t = getattr(self, name)
            if t is not None:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self._host[name] = host.copy_(t, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def _read(self, name: str) -> list:
        return self._host.get(name, getattr(self, name)).tolist()

    def result(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        token_ids = self._read("tokens")
        none_list: list = [None] * self.batch
        if self.sampled_logprobs is None:
            return SamplerOutput(token_ids, none_list, list(none_list))
        sampled = self._read("sampled_logprobs")
        top_vals: list[list[float]] = [[] for _ in self.lp_rows]
        top_ids: list[list[int]] = [[] for _ in self.lp_rows]
        if self.top_values is not None:
            top_vals, top_ids = self._read("top_values"), self._read("top_ids")
        logprobs: list[float | None] = list(none_list)
        top: list[list[tuple[int, float]] | None] = list(none_list)
        for j, i in enumerate(self.lp_rows):
            logprobs[i] = sampled[j]
            top[i] = list(zip(top_ids[j][: self.ks[j]], top_vals[j][: self.ks[j]]))
        return SamplerOutput(token_ids, logprobs, top)
