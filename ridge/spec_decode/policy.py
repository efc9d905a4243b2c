"""How many tokens to speculate this step: only as many as pay for themselves.

A verify step of B sequences runs B (1 + k) rows. While that stays under the machine's ridge
point the step still costs about one read of the weights, so every accepted token is nearly
free; past it the step turns compute-bound and each proposed token costs its arithmetic.
With acceptance rate a (per proposed token, independent), a run of k drafts emits

    E(a, k) = (1 - a^(k+1)) / (1 - a)        tokens per sequence (k + 1 when a = 1)

for a step that costs T(k) (the roofline floor of B sequences x (1 + k) rows, from the
analyzer's cost model on this machine's measured roofline) plus the proposer's c k T(0).
The policy picks the k in [0, K] that maximizes E(a, k) / (T(k) / T(0) + c k); k = 0 is
plain decoding, whose ratio is exactly 1. Acceptance starts at a prior and follows what
verification measures (an exponential moving average over runs).
"""

from __future__ import annotations

from collections.abc import Callable

MIN_GAIN = 0.02  # expected speedup over plain decoding below which k = 0
TOLERANCE = 0.005  # gains this close count as equal (the smaller k wins)
RECOVERY = 0.01  # per step at k = 0: the acceptance estimate's drift back to the prior


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify run of ``k`` drafts emits at per-token acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, step_ratio: float, proposer_cost: float = 0.0) -> float:
    """Tokens per unit time against plain decoding: E(a, k) / (T(k)/T(0) + c k)."""
    return expected_tokens(a, k) / (step_ratio + proposer_cost * k)


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
        self._cache: dict[tuple[int, int], list[float]] = {}

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verify run's outcome: the per-token acceptance it implies, folded in."""
        if num_drafts:
            # accepted drafts over the drafts that were tried (a run stops at the first reject)
            tried = min(num_drafts, num_accepted + 1)
            rate = num_accepted / tried
            self.acceptance += self.smoothing * (rate - self.acceptance)

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
        ratios = self.step_ratios(batch, context)
        a = min(max(self.acceptance, 0.0), 1.0)
        gains = [expected_speedup(a, k, ratios[k], self.proposer_cost) for k in range(self.max_k + 1)]
        best = max(gains)
        k = min(k for k in range(self.max_k + 1) if gains[k] >= best - TOLERANCE)
        if gains[k] < 1.0 + MIN_GAIN:
            # Not speculating teaches nothing about acceptance: drift back towards the prior,
            # so a text that turns repetitive is tried again.
            self.acceptance += RECOVERY * (self.prior_acceptance - self.acceptance)
            return 0
        return k
