"""The PNG plots of a `specdec bench` result (report.PLOTS names them). Each plot's title carries
the target, dtype and hardware; each panel its workload, temperature and batch size."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .runner import SPEC_METHODS  # noqa: E402

COLORS = {"draft-model": "tab:blue", "ngram": "tab:orange", "mtp": "tab:green"}


def suptitle(result: dict) -> str:
    c = result["conditions"]
    return (f"target '{c['target']['name']}' ({c['target']['dtype']}), {c['hardware']['cpu']}, "
            f"{c['hardware']['threads']} threads, {c['repeats']} repeats")


def panel_title(cell: dict) -> str:
    return f"{cell['workload']['name']}, T={cell['sampling']['temperature']:g}, batch {cell['batch_size']}"


def panels(n: int, width: float = 4.2):
    fig, axes = plt.subplots(1, max(n, 1), figsize=(width * max(n, 1), 3.6), squeeze=False)
    return fig, list(axes[0])


def save(fig, result: dict, path: Path) -> None:
    fig.suptitle(suptitle(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def batch1_panels(result: dict):
    """One panel per batch-1 cell: the figure and, per panel, (ax, cell, {method: its results})."""
    cells = [c for c in result["cells"] if c["batch_size"] == 1]
    fig, axes = panels(len(cells))
    by_method = [{m: rs for m in SPEC_METHODS if (rs := [r for r in cell["results"] if r["method"] == m])}
                 for cell in cells]
    return fig, list(zip(axes, cells, by_method))


def finish_panel(ax, cell: dict, **labels) -> None:
    ax.set(title=panel_title(cell), **labels)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)


def speedup_vs_k(result: dict, path: Path) -> None:
    fig, plotted = batch1_panels(result)
    for ax, cell, by_method in plotted:
        for method, rs in by_method.items():
            med = [r["speedup"]["median"] for r in rs]
            err = [[m - r["speedup"]["min"] for m, r in zip(med, rs)], [r["speedup"]["max"] - m for m, r in zip(med, rs)]]
            ax.errorbar([r["k"] for r in rs], med, yerr=err, marker="o", capsize=3, label=method,
                        color=COLORS[method])
        ax.axhline(1, color="gray", lw=0.8, ls="--")
        finish_panel(ax, cell, xlabel="k (draft tokens per step)", ylabel="speedup vs plain")
    save(fig, result, path)


def acceptance_per_position(result: dict, path: Path) -> None:
    fig, plotted = batch1_panels(result)
    for ax, cell, by_method in plotted:
        for method, rs in by_method.items():
            r = max(rs, key=lambda r: r["k"])
            alphas = [a if a is not None else float("nan") for a in r["acceptance_per_position"]]
            ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=f"{method} k={r['k']}",
                    color=COLORS[method])
        finish_panel(ax, cell, xlabel="draft position i", ylabel="α_i", ylim=(0, 1.05))
    save(fig, result, path)


def predicted_vs_measured(result: dict, path: Path) -> None:
    fig, (ax,) = panels(1, 5.5)
    top = 0.0
    for method in SPEC_METHODS:
        pts = [(r["speedup"]["median"], r["predicted_speedup"]) for cell in result["cells"]
               for r in cell["results"] if r["method"] == method and r["predicted_speedup"] is not None]
        if pts:
            ax.scatter(*zip(*pts), label=method, color=COLORS[method])
            top = max(top, *(max(p) for p in pts))
    ax.plot([0, top * 1.1], [0, top * 1.1], color="gray", lw=0.8, ls="--", label="prediction = measurement")
    ax.set(title="every speculative configuration", xlabel="measured speedup", ylabel="predicted speedup")
    ax.legend(fontsize=8)
    save(fig, result, path)


def speedup_vs_batch(result: dict, path: Path) -> None:
    fig, (ax,) = panels(1, 5.5)
    for b in result["batch_effect"]:
        batches = [int(x) for x in b["speedup_by_batch"]]
        ax.plot(batches, list(b["speedup_by_batch"].values()), marker="o", color=COLORS[b["method"]],
                label=f"{b['method']} k={b['k']} ({b['workload']}, T={b['temperature']:g})")
    ax.axhline(1, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(title="speedup vs batch size", xlabel="batch size", ylabel="speedup vs plain (same batch)")
    if result["batch_effect"]:
        ax.legend(fontsize=8)
    save(fig, result, path)


def verify_cost(result: dict, path: Path) -> None:
    fig, (ax, ax_moe) = panels(2, 5.0)
    seen = set()
    for cell in result["cells"]:
        curve = cell["verify_curve"]
        if curve["batch_size"] in seen:
            continue
        seen.add(curve["batch_size"])
        base = curve["seconds"][curve["tokens"].index(1)]
        ax.plot(curve["tokens"], [s / base for s in curve["seconds"]], marker="o",
                label=f"batch {curve['batch_size']} (1 token: {1000 * base:.1f} ms)")
    ax.plot([1, 16], [1, 16], color="gray", lw=0.8, ls=":", label="cost ∝ tokens")
    ax.axhline(1, color="gray", lw=0.8, ls="--", label="ideal: n tokens cost 1")
    ax.set(title=f"target verify cost ({result['conditions']['target']['dtype']})",
           xlabel="tokens per row in one forward", ylabel="t(n) / t(1)")
    ax.legend(fontsize=7)
    moe = result["moe"]
    if moe:
        ax_moe.plot(moe["tokens"], moe["moe_relative"], marker="o", color="tab:red", label="MoE, measured")
        ax_moe.plot(moe["tokens"], moe["moe_relative_estimate"], ls="--", color="tab:red",
                    label="MoE, expert-activation estimate")
        ax_moe.plot(moe["tokens"], moe["dense_relative"], marker="o", color="tab:blue",
                    label="dense (same active size), measured")
        ax_moe.set(title=f"MoE {moe['spec']['num_experts']} experts top-{moe['spec']['top_k']} vs dense "
                         f"({moe['dtype']}, untrained)", xlabel="tokens in one forward", ylabel="t(n) / t(1)")
        ax_moe.legend(fontsize=7)
    else:
        ax_moe.set_axis_off()
    save(fig, result, path)


PLOTS = {  # file name: (what it shows, how it is drawn)
    "speedup_vs_k.png": ("speedup vs k per method (batch 1)", speedup_vs_k),
    "acceptance_per_position.png": ("per-position acceptance α_i (each method at its largest k)",
                                    acceptance_per_position),
    "predicted_vs_measured.png": ("cost model: predicted vs measured speedup", predicted_vs_measured),
    "speedup_vs_batch.png": ("speedup vs batch size (where the gain disappears)", speedup_vs_batch),
    "verify_cost.png": ("verify cost vs tokens per forward; MoE vs dense of the same active size", verify_cost),
}


def write_plots(result: dict, out_dir: Path) -> None:
    for name, (_, draw) in PLOTS.items():
        draw(result, out_dir / name)
