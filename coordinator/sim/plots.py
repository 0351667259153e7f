"""PNG charts of a simulation: hit rate per policy, and the TTFT distribution (CDF) per policy.

matplotlib is an optional dependency (`pip install kvmesh[plots]`); it is imported only here,
only when `--plot` is given, with the non-interactive Agg backend. Charts are kept small
(about 60 KB) so they can live in the repository's docs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.client.extension import NotInThisBuild

_DPI = 80
# Fixed colours, so a policy looks the same in every chart; only kvmesh is red.
_COLORS = {
    "kvmesh": "#d62728",
    "oracle": "#7f7f7f",
    "round_robin": "#1f77b4",
    "least_loaded": "#ff7f0e",
    "session_sticky": "#2ca02c",
    "sglang": "#9467bd",
    "dynamo": "#8c564b",
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise NotInThisBuild(f"--plot needs matplotlib (pip install kvmesh[plots]): {err}") from err
    return plt


def _color(name: str) -> str:
    return _COLORS.get(name, "#17becf")


def write_plots(
    results: Mapping[str, Any], out_dir: str | Path, stem: str, title: str
) -> list[Path]:
    """Write `<stem>-hit-rate.png` and `<stem>-ttft-cdf.png` into `out_dir`; return their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(results)

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    local = [100 * results[n].hit_rate for n in names]
    pulled = [100 * results[n].pulled_rate for n in names]
    colors = [_color(n) for n in names]
    ax.bar(names, local, color=colors, label="local hit")
    bars = ax.bar(
        names,
        pulled,
        bottom=local,
        color=colors,
        alpha=0.45,
        hatch="//",
        label="pulled from a peer",
    )
    ax.bar_label(
        bars, labels=[f"{a + b:.1f}" for a, b in zip(local, pulled, strict=True)], fontsize=8
    )
    ax.set_ylim(0, 1.3 * max(a + b for a, b in zip(local, pulled, strict=True)) + 1e-9)
    if any(pulled):
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_title(f"Hit rate - {title}", fontsize=10)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    hit_path = out / f"{stem}-hit-rate.png"
    fig.savefig(hit_path, dpi=_DPI)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for n in names:
        ttft = np.sort(np.asarray(results[n].ttft_ms))
        cdf = np.arange(1, len(ttft) + 1) / len(ttft)
        style = "--" if n == "oracle" else "-"
        width = 2.0 if n == "kvmesh" else 1.2
        ax.plot(ttft, cdf, style, label=n, color=_color(n), linewidth=width)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF - {title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    cdf_path = out / f"{stem}-ttft-cdf.png"
    fig.savefig(cdf_path, dpi=_DPI)
    plt.close(fig)
    return [hit_path, cdf_path]
