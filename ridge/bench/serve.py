"""`ridge bench serve`: being written."""


def register(subparsers) -> None:
    return None
