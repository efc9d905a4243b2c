"""Placeholder until `ridge analyze` lands (issue 3); registers nothing yet."""


def register(subparsers) -> None:  # noqa: D401
    return None
