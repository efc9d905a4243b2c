"""Benchmarks: latency and throughput of the engine, and a load generator for servers."""
