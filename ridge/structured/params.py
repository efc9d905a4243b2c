"""``StructuredOutputsParams`` (vLLM's name): the one constraint a request's output must meet.

    json         a JSON schema (a dict, or its JSON text): the output is a JSON value that validates
    json_object  any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)
    regex        the whole output matches the regular expression
    choice       the output is one of these strings
    grammar      a context-free grammar: Lark (llguidance's dialect) or llama.cpp's GBNF

Exactly one is set. ``key`` names the constraint (compiled grammars are cached by it);
``grammar_spec`` is the constraint as a grammar backend takes it: a format and its text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc.msg}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            object.__setattr__(self, "json", schema)
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (
                isinstance(self.choice, str)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None))

    def grammar_spec(self) -> tuple[str, str]:
        """(format, text) as ``llguidance.grammar_from`` reads them."""
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = self.json if kind == "json" else {"type": "object"}
            if isinstance(schema, dict) and "x-guidance" not in schema:
                # JSON in its usual compact layout: free whitespace lets a model pad forever
                schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
            return "json_schema", json.dumps(schema)  # properties in the order given
        if kind == "choice":
            return "choice", json.dumps(list(self.choice))
        if kind == "regex":
            return "regex", self.regex
        return "grammar", self.grammar

    @property
    def key(self) -> str:
        return "\0".join(self.grammar_spec())

    @classmethod
    def parse(cls, raw: Any) -> StructuredOutputsParams | None:
        """None, an instance, or a dict of its fields (a request body's ``structured_outputs``)."""
        if raw is None or isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(set(raw) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown key(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
        return cls(**raw)
