"""How many tokens to speculate this step: only as many as pay for themselves.

A verify step of B sequences runs B (1 + k) rows. While that stays under the machine's ridge
point the step still costs about one read of the weights, so every accepted token is nearly
free; past it the step turns compute-bound and each proposed token costs its arithmetic.
With acceptance rate a (per proposed token, independent), a run of k drafts emits

    E(a, k) = (1 - a^(k+1)) / (1 - a)        tokens per sequence (k + 1 when a = 1)

for a step that costs T(k) (the roofline floor of B sequences x (1 + k) rows, from the
analyzer's cost model on this machine's measured roofline) plus the proposer's c k T(0).
A proposer drafts for only a share f of the batch (n-gram lookup finds nothing for a
fresh text), so a step emits 1 + f (E(a, k) - 1) tokens a sequence. The policy picks the k in
[0, K] that maximizes (1 + f (E(a, k) - 1)) / (T(k) / T(0) + c k); k = 0 is plain decoding,
whose ratio is exactly 1. Acceptance and f start at priors and follow what verification and
proposing measure (exponential moving averages).

Where a step is bound by launches and the host rather than by bytes (a GPU at small models),
the roofline's T(k) / T(0) is far from the truth: a verify step also pays the rejection
sampler, a host sync and more rows of attention, and plain steps may be pipelined
(``--async-scheduling``). So the steps the engine runs are timed (``observe_step``) per batch
size (within a factor of 2) and k, and a measured ratio replaces the roofline's. A step the
policy chose k > 0 for counts as k's even where nothing was drafted: that choice kept it from
being pipelined. A verify step's measurement needs a plain step's of the same batch: after the
first verify step the policy runs one plain step to time it. An unmeasured k is priced at its
roofline ratio plus the smallest excess over the roofline that a measured k showed (a verify
step's fixed costs), and never below a smaller k's price.

The tokens a step emits are measured too (``observe_yield``: per decoding sequence, the
verified runs' accepted tokens plus one, one for each sequence without drafts). The model's
1 + f (E(a, k) - 1) assumes every run as long as the acceptance allows; runs cut short by
``max_tokens`` or the context, and sequences left without drafts, emit less (stop 49, H200,
batch 32 with a draft model: acceptance 0.97, yet 0.82x of plain decoding). A measured k's
yield caps its model; an unmeasured k's model is scaled by the worst measured shortfall.
"""

from __future__ import annotations

from collections.abc import Callable

MIN_GAIN = 0.02  # expected speedup over plain decoding below which k = 0
TOLERANCE = 0.005  # gains this close count as equal (the smaller k wins)
RECOVERY = 0.01  # per step at k = 0: the acceptance estimate's drift back to the prior
COVERAGE_RECOVERY = 0.0025  # per step at k = 0: the drafted share's drift back to 1 (a retry in ~50 steps)
TIMING_SMOOTHING = 0.2  # a measured step time's moving average


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify run of ``k`` drafts emits at per-token acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def step_tokens(a: float, k: int, coverage: float = 1.0) -> float:
    """Tokens a step emits a decoding sequence when a share ``coverage`` of them gets ``k``
    drafts: 1 + f (E(a, k) - 1)."""
    return 1.0 + coverage * (expected_tokens(a, k) - 1.0)


def expected_speedup(
    a: float, k: int, step_ratio: float, proposer_cost: float = 0.0, coverage: float = 1.0, tokens: float | None = None
) -> float:
    """Tokens per unit time against plain decoding: (1 + f (E(a, k) - 1)) / (T(k)/T(0) + c k),
    f (``coverage``) the share of sequences that get drafts; ``tokens``: what a step emits a
    sequence where measured (default the model, ``step_tokens``)."""
    emitted = step_tokens(a, k, coverage) if tokens is None else tokens
    return emitted / (step_ratio + proposer_cost * k)


class SpeculationPolicy:
    """``step_time(batch, rows_per_sequence, context)``: a step's floor in seconds."""

    def __init__(
        self,
        max_k: int,
        step_time: Callable[[int, int, int], float],
        proposer_cost: float = 0.0,
        prior_acceptance: float = 0.6,
        smoothing: float = 0.05,
    ) -> None:
        self.max_k = max_k
        self.step_time = step_time
        self.proposer_cost = proposer_cost
        self.prior_acceptance = prior_acceptance
        self.acceptance = prior_acceptance
        self.smoothing = smoothing
        self.coverage = 1.0  # the share of decoding sequences the proposer drafts for (moving average)
        self._cache: dict[tuple[int, int], list[float]] = {}
        self._timed: dict[tuple[int, int], float] = {}  # (batch bucket, k) -> a step's measured seconds
        self._yield: dict[tuple[int, int], float] = {}  # (batch bucket, k) -> tokens a sequence a step

    @staticmethod
    def _bucket(batch: int) -> int:
        return max(1, batch).bit_length()  # batches within a factor of 2 price alike

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verify run's outcome: the per-token acceptance it implies, folded in."""
        if num_drafts:
            # accepted drafts over the drafts that were tried (a run stops at the first reject)
            tried = min(num_drafts, num_accepted + 1)
            rate = num_accepted / tried
            self.acceptance += self.smoothing * (rate - self.acceptance)

    def observe_coverage(self, drafted: int, batch: int) -> None:
        """A proposal round: ``drafted`` of the ``batch`` decoding sequences got drafts."""
        if batch:  # each sequence one observation, as each verify run is for the acceptance; a
            # step at least TIMING_SMOOTHING (a lookup that finds nothing in a fresh text keeps
            # finding nothing: at batch 1, six steps take the share from 1 to 0.26)
            weight = max(TIMING_SMOOTHING, 1.0 - (1.0 - self.smoothing) ** batch)
            self.coverage += weight * (drafted / batch - self.coverage)

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A decode step the engine ran: ``batch`` sequences, at most ``k`` drafts each (0: a
        plain step), ``seconds`` of wall time (its proposing included)."""
        if batch < 1 or seconds <= 0:
            return
        key = (self._bucket(batch), min(k, self.max_k))
        old = self._timed.get(key)
        self._timed[key] = seconds if old is None else old + TIMING_SMOOTHING * (seconds - old)

    def observe_yield(self, batch: int, k: int, tokens: float) -> None:
        """A verify step of ``batch`` decoding sequences at ``k`` emitted ``tokens`` tokens per
        sequence (moving average per batch size and k)."""
        if batch < 1 or k < 1:
            return
        key = (self._bucket(batch), min(k, self.max_k))
        old = self._yield.get(key)
        self._yield[key] = tokens if old is None else old + TIMING_SMOOTHING * (tokens - old)

    def measured_ratios(self, batch: int) -> dict[int, float]:
        """T(k) / T(0) as measured at this batch size, for the k that were timed."""
        bucket = self._bucket(batch)
        plain = self._timed.get((bucket, 0))
        if plain is None:
            return {}
        return {k: t / plain for (b, k), t in self._timed.items() if b == bucket and k}

    def step_ratios(self, batch: int, context: int) -> list[float]:
        """T(k) / T(0) for k = 0 .. max_k (cached per batch and context bucket)."""
        key = (batch, max(1, context).bit_length())  # contexts within a factor of 2 price alike
        ratios = self._cache.get(key)
        if ratios is None:
            base = self.step_time(batch, 1, context)
            ratios = [self.step_time(batch, 1 + k, context) / base for k in range(self.max_k + 1)]
            self._cache[key] = ratios
        return ratios

    def choose_k(self, batch: int, context: int) -> int:
        """The k with the best expected gain; the smallest of those within ``TOLERANCE`` of it,
        and 0 unless the gain beats plain decoding by ``MIN_GAIN`` (a verify run is not free
        of engine overhead, which the roofline does not price)."""
        if batch < 1:
            return 0
        bucket = self._bucket(batch)
        if (bucket, 0) not in self._timed and any(b == bucket for b, _ in self._timed):
            return 0  # a verify step was timed at this batch size: one plain step prices it
        ratios = list(self.step_ratios(batch, context))
        measured = {k: r for k, r in self.measured_ratios(batch).items() if k <= self.max_k}
        # a verify step's fixed costs (the smallest excess over the roofline seen), and no
        # more drafts costing less than fewer did
        fixed = min((max(0.0, r - ratios[k]) for k, r in measured.items()), default=0.0)
        floor = 0.0
        for k in range(1, self.max_k + 1):
            ratios[k] = floor = max(floor, measured[k] if k in measured else ratios[k] + fixed)
        a = min(max(self.acceptance, 0.0), 1.0)
        f = min(max(self.coverage, 0.0), 1.0)
        # what the steps emitted: a measured k's yield caps its model, the worst shortfall scales
        # an unmeasured k's
        model = [step_tokens(a, k, f) for k in range(self.max_k + 1)]
        yields = {k: t for (b, k), t in self._yield.items() if b == bucket and k <= self.max_k}
        shortfall = min([1.0] + [t / model[k] for k, t in yields.items()])
        tokens = model[:1] + [
            min(model[k], yields[k]) if k in yields else model[k] * shortfall for k in range(1, self.max_k + 1)
        ]
        gains = [expected_speedup(a, k, ratios[k], self.proposer_cost, tokens=tokens[k]) for k in range(self.max_k + 1)]
        best = max(gains)
        k = min(k for k in range(self.max_k + 1) if gains[k] >= best - TOLERANCE)
        if gains[k] < 1.0 + MIN_GAIN:
            # Not speculating teaches nothing about acceptance or coverage: drift back towards
            # the priors, so a text that turns repetitive is tried again.
            self.acceptance += RECOVERY * (self.prior_acceptance - self.acceptance)
            self.coverage += COVERAGE_RECOVERY * (1.0 - self.coverage)
            return 0
        return k
