"""``ridge bench {latency,throughput,serve}``: each benchmark registers its own subcommand."""

from __future__ import annotations


def register(subparsers) -> None:
    from ridge.bench import latency, serve, throughput

    bench = subparsers.add_parser("bench", help="benchmarks: latency, throughput, serve")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for module in (latency, throughput, serve):
        module.register(kinds)
