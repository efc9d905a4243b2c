"""What speculation gained: proposed and accepted tokens, in total and by position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_verify_runs: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted drafts plus the target's own token, per run
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at slot j
    drafted_by_position: list[int] = field(default_factory=list)  # drafts proposed at slot j

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verify_runs += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        while len(self.drafted_by_position) < num_drafts:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for j in range(num_drafts):
            self.drafted_by_position[j] += 1
            self.accepted_by_position[j] += j < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify run (accepted drafts + 1): what one target step yields."""
        return self.num_emitted_tokens / self.num_verify_runs if self.num_verify_runs else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def as_dict(self) -> dict:
        return {
            "num_verify_runs": self.num_verify_runs,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position()],
        }
