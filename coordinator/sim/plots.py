"""PNG charts of a simulation: hit rate and goodput per policy, and the TTFT and TPOT
distributions (CDFs) per policy.

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
    """Write `<stem>-hit-rate.png`, `-ttft-cdf.png`, `-tpot-cdf.png` and `-goodput.png` into
    `out_dir`; return their paths."""
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

    paths = [hit_path]
    for key, label in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token")):
        paths.append(_cdf(plt, results, key, label, out / f"{stem}-{key[:4]}-cdf.png", title))
    paths.append(_goodput(plt, results, out / f"{stem}-goodput.png", title))
    return paths


def _cdf(
    plt: Any, results: Mapping[str, Any], key: str, label: str, path: Path, title: str
) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for n in results:
        samples = np.asarray(getattr(results[n], key), dtype=float)
        samples = np.sort(samples[~np.isnan(samples)])  # one-token requests have no TPOT
        cdf = np.arange(1, len(samples) + 1) / max(len(samples), 1)
        style = "--" if n == "oracle" else "-"
        width = 2.0 if n == "kvmesh" else 1.2
        ax.plot(samples, cdf, style, label=n, color=_color(n), linewidth=width)
    ax.set_xscale("log")
    ax.set_xlabel(f"{label} (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{label.capitalize()} CDF - {title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _goodput(plt: Any, results: Mapping[str, Any], path: Path, title: str) -> Path:
    names = list(results)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    good = [results[n].goodput_rps for n in names]
    bars = ax.bar(names, good, color=[_color(n) for n in names])
    ax.bar_label(bars, labels=[f"{g:.1f}" for g in good], fontsize=8)
    ax.set_ylim(0, 1.25 * max(good) + 1e-9)
    ax.set_ylabel("requests/s within the SLO")
    ax.set_title(f"Goodput - {title}", fontsize=10)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path
