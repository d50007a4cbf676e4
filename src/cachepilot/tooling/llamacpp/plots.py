"""The real-model figure: TTFT by the gateway's hit prediction, and the TTFT CDF per policy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachepilot.tooling.loadgen import Result


def plot(phases: dict[str, list[Result]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    labels, data = [], []
    for name, samples in phases.items():
        for pred, tag in ((True, "pred. hit"), (False, "pred. miss")):
            v = [s.ttft_s * 1000.0 for s in samples if s.ok and s.predicted_hit is pred
                 and s.ttft_s is not None]
            labels.append(f"{name}\n{tag}\n(n={len(v)})")
            data.append(v or [float("nan")])
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
    if any(v == v for group in data for v in group):  # any measured value (NaN != NaN)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("TTFT at the client (ms, log)")
    ax.set_title("TTFT by the gateway's prediction")
    ax = axes[1]
    for name, samples in phases.items():
        v = sorted(s.ttft_s * 1000.0 for s in samples if s.ok and s.ttft_s is not None)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    if ax.lines:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend()
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, same traffic")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
