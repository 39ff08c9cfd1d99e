"""The benchmark's figure: one PNG from a result document (matplotlib, Agg backend: no display).

Four panels, one line per run, load level on the x axis (concurrency, or request rate):
TTFT p50/p99, TPOT p50/p99 (with the hardware floor dashed), output-token throughput, and
acceptance length tau (runs that speculate).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _x(level: dict[str, Any]) -> float:
    """Concurrency or request rate; an "inf" rate is not drawn (no place on the axis)."""
    load = level["load"]
    return float(load["concurrency"] if load["concurrency"] is not None else load["request_rate"])


def _xlabel(doc: dict[str, Any]) -> str:
    levels = doc["config"]["levels"]
    if all(lv["concurrency"] is not None for lv in levels):
        return "concurrency (requests in flight)"
    if all(lv["request_rate"] is not None for lv in levels):
        return "request rate (requests/s)"
    return "load (concurrency or requests/s)"


def _series(run: dict[str, Any], path: tuple[str, ...]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for lv in run["levels"]:
        v: Any = lv
        for key in path:
            v = None if v is None else v.get(key)
        if v is not None and math.isfinite(_x(lv)):
            xs.append(_x(lv))
            ys.append(float(v))
    return xs, ys


def plot(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_ttft, ax_tpot), (ax_thr, ax_tau) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    any_tau = False
    for i, run in enumerate(doc["runs"]):
        c = colors[i % len(colors)]
        name = run["name"]
        for ax, key in ((ax_ttft, "ttft_s"), (ax_tpot, "tpot_s")):
            xs, ys = _series(run, (key, "p50"))
            ax.plot(xs, [y * 1e3 for y in ys], "o-", color=c, label=f"{name} p50")
            xs, ys = _series(run, (key, "p99"))
            ax.plot(xs, [y * 1e3 for y in ys], "s:", color=c, alpha=0.7, label=f"{name} p99")
        xs, ys = _series(run, ("floors", "tpot_floor_s"))
        if xs:
            ax_tpot.plot(xs, [y * 1e3 for y in ys], "--", color=c, alpha=0.5,
                         label=f"{name} memory floor")
        xs, ys = _series(run, ("output_throughput",))
        ax_thr.plot(xs, ys, "o-", color=c, label=name)
        xs, ys = _series(run, ("acceptance", "mean_length"))
        if xs:
            any_tau = True
            ax_tau.plot(xs, ys, "o-", color=c, label=name)
    ax_ttft.set_title("time to first token")
    ax_ttft.set_ylabel("ms")
    ax_tpot.set_title("time per output token")
    ax_tpot.set_ylabel("ms")
    ax_thr.set_title("output throughput")
    ax_thr.set_ylabel("tokens/s")
    ax_tau.set_title("acceptance length tau (tokens per round)")
    if not any_tau:
        ax_tau.text(0.5, 0.5, "no run reported acceptance stats\n(not speculative)",
                    ha="center", va="center", transform=ax_tau.transAxes)
    for ax in axes.flat:
        ax.set_xlabel(_xlabel(doc))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        levels = [x for x in (_x({"load": lv}) for lv in doc["config"]["levels"])
                  if math.isfinite(x)]
        if len(levels) > 1 and max(levels) / max(min(levels), 1e-9) >= 8:
            ax.set_xscale("log", base=2)
    wl = doc["config"]["workload"]
    fig.suptitle(f"tandem bench {doc['date']}: {wl['kind']} workload, input "
                 f"{wl['input_len'][0]}-{wl['input_len'][1]}, output "
                 f"{wl['output_len'][0]}-{wl['output_len'][1]} tokens", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
