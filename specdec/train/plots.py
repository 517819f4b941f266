"""The training curves a run draws beside its export (loss.png): next-token and MTP heads' losses,
distillation's KL and greedy agreement, and the per-position KL and acceptance of the drafters
trained per draft position (EAGLE and block heads, parallel drafts). Drawn without a display.

This module knows nothing about training; it reads a run's history (objectives.py records it).
"""
from __future__ import annotations

from pathlib import Path


def plot_per_position(history: dict, path: Path, title: str, what: str = "step") -> None:
    """Training KL (mean of the unrolled steps, or of a parallel draft's block slots: `what`),
    validation KL per step and alpha per position."""
    fig, ax = _figure((7, 4.5))
    _curve(ax, history["train"], alpha=0.5, label=f"train KL, mean of the {what}s")
    if history.get("valid_heads"):
        s, per_step = zip(*history["valid_heads"])
        for j, l in enumerate(zip(*per_step)):
            ax.plot(s, l, marker=".", linestyle="--", label=f"validation KL, draft {j + 1}")
    ax.set(xlabel="step", ylabel="KL(target || draft) (nats per token)", title=title)
    right = None
    if history.get("valid_alpha"):
        right = ax.twinx()
        s, per_position = zip(*history["valid_alpha"])
        for j, a in enumerate(zip(*per_position)):
            right.plot(s, a, marker="s", markersize=3, label=f"validation greedy α_{j + 1}")
        right.set(ylabel="α_i (greedy acceptance)", ylim=(0, 1))
    _save(fig, ax, path, right, loc="center right", fontsize=7)


def plot_distill_history(history: dict, path: Path, title: str) -> None:
    """KL(target || draft) in training and validation, and the validation greedy agreement."""
    fig, ax = _figure((6, 4))
    _curve(ax, history["train"], alpha=0.5, label="train KL")
    _curve(ax, history["valid"], marker="o", label="validation KL")
    ax.set(xlabel="step", ylabel="KL(target || draft) (nats per token)", title=title)
    right = None
    if history.get("valid_agreement"):
        right = ax.twinx()
        _curve(right, history["valid_agreement"], marker="s", color="tab:green", label="validation greedy agreement")
        right.set_ylabel("argmax(draft) == argmax(target)")
    _save(fig, ax, path, right, loc="center right")


def plot_history(history: dict, path: Path, title: str, train_label: str = "train") -> None:
    fig, ax = _figure((6, 4))
    _curve(ax, history["train"], alpha=0.5, label=train_label)
    _curve(ax, history["valid"], marker="o", label="validation, next token")
    if history.get("valid_heads"):
        s, per_head = zip(*history["valid_heads"])
        for j, l in enumerate(zip(*per_head)):
            ax.plot(s, l, marker=".", linestyle="--", label=f"validation, MTP head {j + 1} (t+{j + 2})")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
    _save(fig, ax, path)


def plot_learning_curve(points: list[dict], path: Path, title: str, break_even: dict[str, float]) -> None:
    """Held-out α_1 and the last α_i of each evaluation group against tokens seen (longrun.whole_curve's
    points), with horizontal lines at the cost model's break-even α (`break_even`: label -> α)."""
    fig, ax = _figure((7, 4.5))
    tokens = [p["tokens_seen"] / 1e6 for p in points]
    for name in (name for name in points[0] if name != "tokens_seen"):
        last = len(points[0][name]) - 1
        for i, style in ((0, "-"), (last, ":")):
            ax.plot(tokens, [p[name][i] for p in points], marker="o", markersize=3, linestyle=style,
                    label=f"{name} α_{i + 1}")
    for (label, alpha), color in zip(break_even.items(), ("black", "grey", "tab:red", "tab:brown")):
        ax.axhline(alpha, color=color, linestyle="--", linewidth=1, label=f"break-even α, {label}")
    ax.set(xlabel="tokens seen (millions)", ylabel="held-out α_i", ylim=(0, 1), title=title)
    _save(fig, ax, path, loc="upper left", fontsize=7, ncol=2)


def _figure(size: tuple[float, float]):
    """A figure and its axes for a training curve, drawn without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=size)


def _curve(ax, points: list, **style) -> None:
    """(step, value) points as one line, if there are any."""
    if points:
        s, v = zip(*points)
        ax.plot(s, v, **style)


def _save(fig, ax, path: Path, right=None, **legend) -> None:
    """The grid, one legend for both axes (`right`: a twin axis, if any), then the figure at `path`."""
    import matplotlib.pyplot as plt
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, **legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
