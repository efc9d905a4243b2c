"""Issue 21's CPU targets against what the benchmarks measured on this CPU: one table.

Reads the JSON the benchmarks wrote (nothing is measured here) and prints, per target and
file or format, the measured figure, the target and whether it is met:

  - batch-1 decode at least 1.2x llama.cpp on every file (``compare.py``'s ``ridge_speedup``,
    the median of its rounds) and each file within 90% of its floor (``decode_floor_fraction``:
    the file's weight bytes over the bandwidth probed around its run; a median over 100%
    is not met: the step streamed faster than the probe read, so the probe missed the memory's
    level, and such a floor judges nothing);
  - tg64 and pp512 at least ik_llama.cpp's ``llama-bench`` on every file (``vs_ik.py``, the
    median of the per-round ratios, this CPU's entry);
  - 2-8 rows at most 1.3x one row in every format (``quant_rows.py``, this CPU's entry);
  - decode attention over an int8 KV cache at least 1.6x bf16's at 4,096-token contexts
    (``quantized_decode.py``'s KV part, where its run was on this CPU).

    python benchmarks/targets.py --compare benchmarks/compare_targets_amd.json

``benchmarks/cpu_targets.sh`` runs the benchmarks and then this.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).parent
LLAMACPP_SPEEDUP = 1.2  # ridge / llama.cpp, batch-1 decode
FLOOR_FRACTION = 0.9
IK_RATIO = 1.0  # ridge / ik_llama.cpp, tg64 and pp512
ROWS_COST = 1.3  # a step of 2-8 rows against one row
KV_INT8_SPEEDUP = 1.6  # int8 KV decode attention / bf16's, 4k contexts


def compare_rows(compare: dict) -> list[tuple[str, str, str, str, bool]]:
    summary = compare["summary"]["batch1"]
    engines, speedup = summary["engines"], summary["ridge_speedup"]
    rows = []
    for name in engines:
        if not name.startswith("ridge "):
            continue
        file = name.removeprefix("ridge ")
        if file.startswith("--quantization"):
            continue
        peer = speedup.get(f"llama.cpp {file}")
        if peer is not None:
            value = peer["median"]
            rows.append(
                (
                    "decode b1 vs llama.cpp",
                    file,
                    f"{value:.2f}x ({peer['min']:.2f}-{peer['max']:.2f})",
                    f">= {LLAMACPP_SPEEDUP}x",
                    value >= LLAMACPP_SPEEDUP,
                )
            )
        floor = engines[name].get("decode_floor_fraction")
        if floor is not None:
            value = floor["median"]
            figure, met = f"{value:.0%}", FLOOR_FRACTION <= value <= 1.0
            if value > 1.0:
                figure += " (over 100%: the probe read low)"
            rows.append(("decode b1 % of floor", file, figure, f">= {FLOOR_FRACTION:.0%}", met))
    return rows


def cpu_entry(path: Path, cpu: str) -> dict | None:
    """This CPU's entry in a per-CPU JSON (``vs_ik.json``, ``quant_rows.json``), if any."""
    return json.loads(path.read_text()).get(cpu) if path.is_file() else None


def ik_rows(entry: dict | None) -> list[tuple[str, str, str, str, bool]]:
    rows = []
    for file, figures in (entry or {}).get("files", {}).items():
        for test in ("tg64", "pp512"):
            value, each = figures[f"{test}_ratio"], figures[f"{test}_ratios"]
            rows.append(
                (
                    f"{test} vs ik_llama.cpp",
                    file,
                    f"{value:.2f}x ({min(each):.2f}-{max(each):.2f})",
                    f">= {IK_RATIO}x",
                    value >= IK_RATIO,
                )
            )
    return rows


def quant_rows(entry: dict | None) -> list[tuple[str, str, str, str, bool]]:
    rows = []
    for fmt, figures in (entry or {}).get("formats", {}).items():
        costs = {int(m): cell["vs_one_row"] for m, cell in figures["rows"].items() if 2 <= int(m) <= 8}
        if costs:
            worst = max(costs.values())
            shown = ", ".join(f"{m}: {c:.2f}x" for m, c in sorted(costs.items()))
            rows.append(("2-8 rows vs one row", fmt, shown, f"<= {ROWS_COST}x", worst <= ROWS_COST))
    return rows


def kv_rows(run: dict | None) -> list[tuple[str, str, str, str, bool]]:
    """quantized_decode.py's KV part: the int8 cache's decode attention against bf16's."""
    if not run:
        return []
    int8 = run["summary"]["kv"].get("int8")
    if int8 is None:
        return []
    value = int8["attention_vs_bf16"]
    what = f"batch {run['kv_batch']}, {run['kv_context']} tokens"
    return [("int8 KV attention vs bf16", what, f"{value:.2f}x", f">= {KV_INT8_SPEEDUP}x", value >= KV_INT8_SPEEDUP)]


def main(argv: list[str] | None = None) -> int:
    from ridge.roofline.probe import cpu_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, required=True, help="compare.py's --json of a batch1 run")
    parser.add_argument("--vs-ik", type=Path, default=HERE / "vs_ik.json")
    parser.add_argument("--quant-rows", type=Path, default=HERE / "quant_rows.json")
    parser.add_argument("--quantized-decode", type=Path, default=HERE / "quantized_decode.json")
    parser.add_argument(
        "--cpu", default=None, help="the CPU entry to read (default: the --compare run's CPU, else this machine's)"
    )
    args = parser.parse_args(argv)
    compare = json.loads(args.compare.read_text())
    machine = compare.get("machine", {})
    # one machine's figures: the other runs' entries for the CPU the files were run on, never
    # another machine's beside them (a Xeon session reading the AMD run's file)
    cpu = args.cpu or machine.get("cpu") or cpu_model()
    ik, per_rows = cpu_entry(args.vs_ik, cpu), cpu_entry(args.quant_rows, cpu)
    kv_run = json.loads(args.quantized_decode.read_text()) if args.quantized_decode.is_file() else None
    kv_here = kv_run if kv_run and kv_run.get("machine") == cpu else None  # a run of this CPU only
    rows = compare_rows(compare) + ik_rows(ik) + quant_rows(per_rows) + kv_rows(kv_here)
    print(f"Issue 21's targets on {cpu}, from:")
    prefetch = machine.get("cpu_prefetch")  # the kernels' prefetch policy in that run (csrc/prefetch.cpp)
    policy = f", prefetch {','.join(f'{k}={v}' for k, v in sorted(prefetch.items()))}" if prefetch else ""
    print(f"- {args.compare}: {machine.get('date', '?')}, {machine.get('cpu', '?')}{policy}")
    for path, entry in ((args.vs_ik, ik), (args.quant_rows, per_rows)):
        said = f"{entry.get('date', '?')}, {entry.get('rounds', '?')} rounds" if entry else f"no entry for {cpu}"
        if entry and path == args.quant_rows:  # weights of 1 layer (before 2026-11-27) may stay in cache
            layers = entry.get("layers", 1)
            said += f", weights of {layers} layer{'' if layers == 1 else 's'}"
        print(f"- {path}: {said}")
    if kv_run:
        said = f"{kv_run.get('date', '?')}, {kv_run.get('rounds', '?')} rounds"
        print(f"- {args.quantized_decode}: {said}" + ("" if kv_here else f", on {kv_run.get('machine')}: not this CPU"))
    print()
    print("| target | file / format | measured | target | met |")
    print("|---|---|---|---|---|")
    for target, what, figure, goal, met in rows:
        print(f"| {target} | {what} | {figure} | {goal} | {'yes' if met else '**no**'} |")
    missed = sum(not met for *_, met in rows)
    print(f"{len(rows) - missed} of {len(rows)} met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
