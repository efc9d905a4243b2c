"""Placeholder until `ridge serve` lands."""


def register(subparsers) -> None:
    return None
