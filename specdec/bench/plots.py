"""The PNG plots of a `specdec bench` result (report.PLOTS names them). Each plot's title carries
the target, dtype and hardware; each panel its workload, temperature and batch size. A plot with
nothing to show (no batch-1 cell, no configuration measured at two batch sizes) is not written."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .runner import SPEC_METHODS  # noqa: E402

COLORS = {method: f"C{i % 10}" for i, method in enumerate(SPEC_METHODS)}  # a drafter's colour: its registry place


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
    # the k sweep: fixed chains (adaptive and tree configurations have their own table in the report)
    by_method = [{m: rs for m in SPEC_METHODS if (rs := [r for r in cell["results"] if r["method"] == m
                                                          and isinstance(r["k"], int) and not r.get("widths")])}
                 for cell in cells]
    return fig, list(zip(axes, cells, by_method))


def finish_panel(ax, cell: dict, xs: list[int], **labels) -> None:
    """Title, labels, legend; ticks at the integers xs measured (one each, never crowded)."""
    ax.set(title=panel_title(cell), **labels)
    xs = sorted(set(xs))
    if len(xs) == 1:
        ax.set_xlim(xs[0] - 1, xs[0] + 1)
    if 0 < len(xs) <= 12:
        ax.set_xticks(xs)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)


def batch1_chains(result: dict) -> bool:
    """Whether a batch-1 cell ran a speculative method at a fixed k (a chain): what the k plots show."""
    return any(r["method"] in SPEC_METHODS and isinstance(r["k"], int) and not r.get("widths")
               for c in result["cells"] if c["batch_size"] == 1 for r in c["results"])


def batch1_plot(draw, result: dict, path: Path) -> bool:
    """One panel per batch-1 cell, each drawn by draw(ax, cell, {method: its fixed-k results});
    nothing where no batch-1 cell ran a chain."""
    if not batch1_chains(result):
        return False
    fig, plotted = batch1_panels(result)
    for ax, cell, by_method in plotted:
        draw(ax, cell, by_method)
    save(fig, result, path)
    return True


def speedup_vs_k(ax, cell: dict, by_method: dict) -> None:
    for method, rs in by_method.items():
        med = [r["speedup"]["median"] for r in rs]
        err = [[m - r["speedup"]["min"] for m, r in zip(med, rs)], [r["speedup"]["max"] - m for m, r in zip(med, rs)]]
        ax.errorbar([r["k"] for r in rs], med, yerr=err, marker="o", capsize=3, label=method, color=COLORS[method])
    ax.axhline(1, color="gray", lw=0.8, ls="--")
    finish_panel(ax, cell, [r["k"] for rs in by_method.values() for r in rs],
                 xlabel="k (draft tokens per step)", ylabel="speedup vs plain")


def acceptance_per_position(ax, cell: dict, by_method: dict) -> None:
    for method, rs in by_method.items():
        r = max(rs, key=lambda r: r["k"])
        alphas = [a if a is not None else float("nan") for a in r["acceptance_per_position"]]
        ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=f"{method} k={r['k']}", color=COLORS[method])
    positions = [i for rs in by_method.values() for i in range(1, max(r["k"] for r in rs) + 1)]
    finish_panel(ax, cell, positions, xlabel="draft position i", ylabel="α_i", ylim=(0, 1.05))


def predicted_vs_measured(result: dict, path: Path) -> bool:
    if not any(r["predicted_speedup"] is not None for cell in result["cells"] for r in cell["results"]):
        return False
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
    return True


def speedup_vs_batch(result: dict, path: Path) -> bool:
    """Only where the plan measured one prompt set at two batch sizes or more (result["batch_effect"])."""
    if not result["batch_effect"]:
        return False
    fig, (ax,) = panels(1, 5.5)
    for b in result["batch_effect"]:
        batches = [int(x) for x in b["speedup_by_batch"]]
        ax.plot(batches, list(b["speedup_by_batch"].values()), marker="o", color=COLORS[b["method"]],
                label=f"{b['label']} ({b['workload']}, T={b['temperature']:g})")
    ax.axhline(1, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(title="speedup vs batch size", xlabel="batch size", ylabel="speedup vs plain (same batch)")
    ax.legend(fontsize=8)
    save(fig, result, path)
    return True


def verify_cost(result: dict, path: Path) -> bool:
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
    return True


PLOTS = {  # file name: (what it shows, how it is drawn)
    "speedup_vs_k.png": ("speedup vs k per method (batch 1)", partial(batch1_plot, speedup_vs_k)),
    "acceptance_per_position.png": ("per-position acceptance α_i (each method at its largest k)",
                                    partial(batch1_plot, acceptance_per_position)),
    "predicted_vs_measured.png": ("cost model: predicted vs measured speedup", predicted_vs_measured),
    "speedup_vs_batch.png": ("speedup vs batch size (where the gain disappears)", speedup_vs_batch),
    "verify_cost.png": ("verify cost vs tokens per forward; MoE vs dense of the same active size", verify_cost),
}


def write_plots(result: dict, out_dir: Path) -> list[str]:
    """Write every plot that has something to show; return their file names (a plot left out is
    also removed from out_dir, so no stale one from an earlier run remains)."""
    written = []
    for name, (_, draw) in PLOTS.items():
        if draw(result, out_dir / name):
            written.append(name)
        else:
            (out_dir / name).unlink(missing_ok=True)
    return written
