"""``--plot FILE.png``: the roofline with every operator and phase on it, and throughput vs latency.

Left: attainable FLOP/s = min(peak, intensity x bandwidth) on log-log axes; each operator sits
at (its intensity, its FLOPs / its roofline time), so it lies on the roof by construction and
the reader sees which side of the ridge it is on. Phases (prefill, each decode batch) are the
large markers. Right: decode tokens/s against time per output token over a batch sweep, with
batches that do not fit in memory hollow.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from ridge.roofline.analyze import Analysis, Phase  # noqa: E402


def plot_analysis(analysis: Analysis, path: str | Path) -> Path:
    """Write the two-panel PNG and return its path."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot needs a .png file name, got {str(path)!r}")
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1.25, 1]})
    try:
        _roofline_panel(left, analysis)
        _throughput_panel(right, analysis)
        a = analysis
        fig.suptitle(
            f"{a.model.name} on {a.hardware.name} ({a.roof.dtype}): prompt {a.workload.prompt_len}, "
            f"output {a.workload.output_len}, weights {a.workload.precision.weight_bits}-bit, "
            f"KV {a.workload.precision.kv_bits}-bit, TP {a.conventions.cost.tensor_parallel}",
            fontsize=12,
        )
        conv = a.conventions.cost
        fig.text(
            0.01,
            0.01,
            f"conventions: attention FLOPs {conv.attention}; embedding {conv.embedding} rows; minimum bytes "
            "(each operand once); time = max(FLOPs/peak, bytes/bandwidth) per op; TPOT = mean over the "
            "generation; memory fit = weights + full-length KV",
            fontsize=7.5,
            color="0.35",
        )
        fig.tight_layout(rect=(0, 0.03, 1, 0.95))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _roofline_panel(ax, a: Analysis) -> None:
    roof = a.roof
    phases: list[Phase] = [a.prefill, *a.decode]
    intensities = [op.intensity for p in phases for op in p.cost.ops if op.flops > 0]
    lo = min(0.1, min(intensities) / 2)
    hi = max(roof.ridge_point * 20, max(intensities) * 2)
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    ax.plot(x, np.minimum(roof.peak_flops, x * roof.bandwidth), color="black", lw=2, label="roofline")
    ax.axvline(roof.ridge_point, color="0.5", ls=":", lw=1)
    ax.text(
        roof.ridge_point * 1.08,
        roof.peak_flops * 0.03,
        f"ridge {roof.ridge_point:.0f} FLOP/B",
        rotation=90,
        color="0.35",
        fontsize=8,
        va="bottom",
    )

    colors = plt.cm.viridis(np.linspace(0.15, 0.85, max(1, len(a.decode))))
    styles = [("prefill", a.prefill, "tab:red")] + [
        (f"decode B={p.batch} ctx {p.context_len}", p, colors[i]) for i, p in enumerate(a.decode)
    ]
    for label, phase, color in styles:
        ops = [op for op in phase.cost.ops if op.flops > 0]
        xs = [op.intensity for op in ops]
        ys = [op.flops / op.time_s(roof.peak_flops, roof.bandwidth) for op in ops]
        ax.scatter(xs, ys, s=22, color=color, alpha=0.75, edgecolors="none")
        px = phase.intensity
        py = phase.cost.flops / phase.time_s
        ax.scatter(
            [px],
            [py],
            s=170,
            marker="*",
            color=color,
            edgecolors="black",
            linewidths=0.6,
            zorder=5,
            label=f"{label}: {phase.time_s * 1e3:.3g} ms",
        )
    # Name the heaviest operators of prefill and of the largest decode batch; operators that land
    # on the same spot (attention scores and weighted sum, same-shape projections) share a label.
    labels: dict[tuple[int, int], list[str]] = {}
    spots: dict[tuple[int, int], tuple[float, float]] = {}
    for phase in (a.prefill, a.decode[-1]):
        top = sorted(phase.cost.ops, key=lambda op: -op.time_s(roof.peak_flops, roof.bandwidth))[:3]
        for op in top:
            if op.flops == 0:
                continue
            xy = (op.intensity, op.flops / op.time_s(roof.peak_flops, roof.bandwidth))
            key = (round(np.log10(xy[0]) * 4), round(np.log10(xy[1]) * 4))
            if op.name not in labels.setdefault(key, []):
                labels[key].append(op.name)
            spots[key] = xy
    for key, names in labels.items():
        ax.annotate(
            "\n".join(names), spots[key], fontsize=7, xytext=(5, -6), textcoords="offset points", color="0.25", va="top"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(x[0] * roof.bandwidth, roof.peak_flops / 1e4), roof.peak_flops * 2.5)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel(f"attained FLOP/s ({roof.dtype})")
    ax.set_title("Roofline: operators (dots) and phases (stars)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7.5, loc="lower right")


def _throughput_panel(ax, a: Analysis) -> None:
    points = a.sweep
    xs = np.array([p.tpot_s * 1e3 for p in points])
    ys = np.array([p.tokens_per_s for p in points])
    ax.plot(xs, ys, color="tab:blue", lw=1.5, zorder=1)
    fit = np.array([p.fits for p in points])
    ax.scatter(xs[fit], ys[fit], color="tab:blue", s=28, zorder=2, label="fits in memory")
    if (~fit).any():
        ax.scatter(
            xs[~fit],
            ys[~fit],
            facecolors="white",
            edgecolors="tab:blue",
            s=28,
            zorder=2,
            label=f"exceeds memory (max batch {a.max_batch:,})",
        )
    requested = set(a.workload.batches)
    knee = a.compute_bound_batch_linear
    for p in points:
        if p.batch in requested or p.batch == 1:
            ax.annotate(
                f"B={p.batch}", (p.tpot_s * 1e3, p.tokens_per_s), fontsize=8, xytext=(5, -3), textcoords="offset points"
            )
    floor_ms = a.decode_floor_s * 1e3
    ax.axvline(floor_ms, color="0.5", ls=":", lw=1)
    ax.text(floor_ms * 1.03, ys.min(), "decode floor", rotation=90, fontsize=8, color="0.35", va="bottom")
    title = "Decode throughput vs time per output token"
    if knee:
        title += f"\n(linear layers compute-bound from batch {knee:,})"
    ax.set_title(title)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time per output token (ms, mean over the generation)")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(_sparse_minor_label))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")


def _sparse_minor_label(value: float, _position) -> str:
    """Label only the 2x and 5x minor ticks of a log axis, so they never crowd."""
    mantissa = value / 10 ** np.floor(np.log10(value))
    return f"{value:g}" if round(mantissa) in (2, 5) else ""
