"""The OpenAI-compatible server (issue 4): being written."""
