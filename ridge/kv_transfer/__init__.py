"""Prefill and decode on separate instances: the KV cache moved between them (see ``connector``)."""
