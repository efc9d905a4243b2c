"""Structured output: constraints on what a request may generate, enforced token by token."""
