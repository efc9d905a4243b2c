"""``ridge router``: an OpenAI-compatible front over prefill/decode or replica instances."""
