"""``--speculative-config``: vLLM's JSON keys, checked before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ridge.flags import json_object

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """How to speculate.

    method: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence
        of the sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
        or ``draft_model`` (a smaller model with the same tokenizer, ``model``).
    num_speculative_tokens: the most tokens proposed per sequence and step (k).
    adaptive: lower k per step while verifying would make the step compute-bound, and to what
        the measured acceptance makes worthwhile (False: always propose k).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    model: str | None = None
    adaptive: bool = True
    # the draft model's own options (dtype, quantization, ...): keywords of LLM(...)
    draft_options: dict | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
            if self.model is not None:
                raise ValueError("the ngram method takes no model; use method 'draft_model' for one")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "method 'draft_model' needs \"model\": a model directory, .gguf file or random:<preset>"
                )
        if self.draft_options is not None and not isinstance(self.draft_options, dict):
            raise ValueError("draft_options must be an object of engine options")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON string (the CLI flag), a dict (``LLM(speculative_config=...)``) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "--speculative-config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative config needs {required!r}")
        return cls(**value)
