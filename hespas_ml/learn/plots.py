"""Plots of a surrogate's held-out predictions, logged with each training run: a parity plot and error
histograms, both by op family (:data:`hespas_ml.split.families.FAMILIES`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..split.families import FAMILIES


def plot_parity(rows, seconds: np.ndarray, ops: np.ndarray, path: Path, title: str) -> Path:
    """Predicted against true seconds (log-log), coloured by op family, with the ±10 % band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    true = rows["seconds"].to_numpy(dtype=np.float64)
    fig, ax = plt.subplots(figsize=(6, 6), dpi=110)
    for fam in FAMILIES:
        sel = ops == fam
        if sel.any():
            ax.scatter(true[sel], seconds[sel], s=6, alpha=0.6, label=f"{fam} ({int(sel.sum())})")
    lo = float(min(true.min(), seconds.min())) / 1.5
    hi = float(max(true.max(), seconds.max())) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.fill_between([lo, hi], [lo / 1.1, hi / 1.1], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15, lw=0)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="label (s)", ylabel="predicted (s)",
           title=title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_error_histogram(rows, seconds: np.ndarray, ops: np.ndarray, path: Path, title: str) -> Path:
    """Histograms of the signed error ``predicted / label − 1`` (log-spaced) per op family."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    err = np.log10(seconds / rows["seconds"].to_numpy(dtype=np.float64))
    fams = [f for f in FAMILIES if (ops == f).any()]
    fig, axes = plt.subplots(len(fams), 1, figsize=(6, 1.4 * len(fams) + 0.8), dpi=110, sharex=True,
                             squeeze=False)
    span = max(float(np.quantile(np.abs(err), 0.99)) if len(err) else 0.0, 1e-3)
    bins = np.linspace(-span, span, 41)
    for ax, fam in zip(axes[:, 0], fams):
        e = err[ops == fam]
        ax.hist(np.clip(e, -span, span), bins=bins, color="tab:blue")
        ax.axvline(0.0, color="black", lw=0.8)
        med = float(np.median(np.abs(np.expm1(e * np.log(10)))))
        ax.set_ylabel(fam, rotation=0, ha="right", fontsize=8)
        ax.text(0.99, 0.8, f"n={len(e)}  median |err| {100 * med:.2f}%", transform=ax.transAxes, ha="right",
                fontsize=7)
    ticks = axes[-1, 0].get_xticks()
    axes[-1, 0].set_xticks(ticks, [f"{100 * (10 ** t - 1):+.0f}%" for t in ticks])
    axes[-1, 0].set_xlim(-span, span)
    axes[-1, 0].set_xlabel("predicted / label − 1")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
