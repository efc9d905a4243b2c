"""``ridge bench {latency,throughput,serve,quality}``: each benchmark registers its own subcommand."""

from __future__ import annotations


def register(subparsers) -> None:
    from ridge.bench import latency, quality, serve, throughput

    bench = subparsers.add_parser("bench", help="benchmarks: latency, throughput, serve, quality")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for module in (latency, throughput, serve, quality):
        module.register(kinds)
