"""What `specdec bench` writes: the console table, bench.json, report.md and the PNG plots.

Every table of speedups is printed with its conditions beside it: the cell's workload, batch size
and sampling settings in its heading, method config (k), α and τ in its rows, and the target,
draft, hardware, software and repeats below it.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..proposers import DRAFTERS
from .plots import PLOTS, write_plots

JSON_NAME, REPORT_NAME = "bench.json", "report.md"


def num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def spread_text(s: dict, fmt: str = ".1f", suffix: str = "") -> str:
    return f"{s['median']:{fmt}}{suffix} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def lossless_text(r: dict) -> str:
    check = r["lossless"]
    if not check["checked"]:
        return "n/a (sampling)"
    text = f"{check['identical']}/{check['prompts']} vs {check['reference']}"
    if check["mismatches"]:
        text += "; differ: " + ", ".join(f"prompt {m['prompt']} from token {m['first_difference']}"
                                         for m in check["mismatches"])
    return text


def cell_heading(cell: dict) -> str:
    w, s = cell["workload"], cell["sampling"]
    p = w["prompt_tokens"]
    return (f"{w['name']}: {w['prompts']} prompts ({p['min']}-{p['max']} tokens), {w['max_new_tokens']} new tokens "
            f"each (EOS ignored), temperature {s['temperature']:g} (seed {s['seed']}), batch {cell['batch_size']}")


def cell_table(cell: dict) -> list[str]:
    """The cell's table; a noisy figure is marked NOISY and the reasons follow the table."""
    lines = ["| method | α | τ | tokens/s median (min-max) | speedup (min-max) | predicted | lossless check |",
             "|---|---|---|---|---|---|---|"]
    for r in cell["results"]:
        lines.append(f"| {r['label']} | {num(r['acceptance_rate'])} | {num(r['mean_acceptance_length'])} | "
                     f"{spread_text(r['tokens_per_s'])} | {spread_text(r['speedup'], '.2f', 'x')}"
                     f"{' NOISY' if r['noise'] else ''} | "
                     f"{num(r['predicted_speedup'])}{'x' if r['predicted_speedup'] is not None else ''} | "
                     f"{lossless_text(r)} |")
    return lines + noise_lines(cell)


def noise_lines(cell: dict) -> list[str]:
    """Why the cell's NOISY figures are not results (specdec/bench/noise.py)."""
    lines = [f"NOISY {r['label']}: {'; '.join(r['noise'])}" for r in cell["results"] if r["noise"]]
    points = cell["verify_curve"]["implausible"]
    if points:
        lines.append("NOISY verify-cost curve: " + ", ".join(f"t({n}) is {ratio:.2f}x its neighbour" for n, ratio in points)
                     + " (more tokens cannot cost much less, nor fewer much more): the machine was busy")
    if lines:
        lines.append("NOISY figures are not results: rerun on a quiet machine or with more --repeats.")
    return lines


def curve_lines(result: dict, cell: dict) -> list[str]:
    """The cell's verify-cost curve with its arithmetic: matrix FLOPs per forward, the rate they
    ran at against the measured FMA peak, and one token's weight bytes against the measured read
    bandwidth."""
    curve, roof = cell["verify_curve"], result["conditions"].get("roofline", {})
    roof = roof if isinstance(roof, dict) else {}  # not measured: the models ran on a GPU
    params = result["conditions"]["target"].get("matrix_parameters")
    B, t1 = curve["batch_size"], curve["seconds"][0]
    lines = [f"Verify-cost curve: one target forward over n new tokens per row at batch {B}"
             + (f", after {curve['context_tokens']} cached tokens" if "context_tokens" in curve else "")
             + (f"; matrix FLOPs = 2 x {params / 1e6:.1f}M parameters x {B} x n" if params else "") + ".", "",
             "| n | ms | t(n)/t(1) | matrix GFLOP/s | of the FMA peak |", "|---|---|---|---|---|"]
    peak = roof.get("fma_peak_gflops")
    for n, s in zip(curve["tokens"], curve["seconds"]):
        rate = 2 * params * B * n / s / 1e9 if params else None
        share = f"{100 * rate / peak:.0f}%" if rate and isinstance(peak, float) else "unknown"
        lines.append(f"| {n} | {1000 * s:.3f} | {s / t1:.2f} | {num(rate, '.0f')} | {share} |")
    bandwidth = roof.get("read_bandwidth_GBps")
    if params and isinstance(bandwidth, float):
        lines += ["", f"A forward reads the {2 * params / 1e6:.1f} MB of bf16 matrices once for its {B} row(s): "
                      f"{2 * params / t1 / 1e9:.1f} GB/s at t(1), against {bandwidth:.1f} GB/s measured "
                      f"(summing 512 MB) and an FMA peak of {num(peak, '.0f')} GFLOP/s ({roof.get('isa')}, "
                      f"{roof.get('threads')} threads)."]
    return lines


PHASES = ("propose", "forward", "acceptance", "commit", "observe", "metrics", "other")


def step_breakdown_lines(result: dict) -> list[str]:
    """Where a step's time goes (metrics.step_breakdown_ms), per configuration of each batch-1 cell,
    and the bookkeeping beyond the forward passes as a fraction of one target token's forward."""
    lines = ["## Step breakdown", "",
             "Milliseconds per step (one target forward) of each phase of the engine's loop, from the last "
             "repeat's counters. *propose* holds the draft forwards of model drafts and all of n-gram lookup; "
             "*observe* the proposer's bookkeeping (and draft-cache updates); *bookkeeping* = acceptance + commit + "
             "metrics + other, plus propose and observe for n-gram (which has no forward), over t(1).", "",
             "| cell | method | " + " | ".join(PHASES) + " | bookkeeping / t(1) |", "|---|---|" + "---|" * (len(PHASES) + 1)]
    for cell in result["cells"]:
        if cell["batch_size"] != 1:
            continue
        t1 = cell["verify_curve"]["seconds"][0]
        for r in cell["results"]:
            parts = (r.get("counters") or {}).get("step_breakdown_ms")
            if not parts:
                continue
            own = ["acceptance", "commit", "metrics", "other"] + (["propose", "observe"] if r["method"] == "ngram" else [])
            overhead = sum(parts[p] for p in own) / 1e3 / t1
            lines.append(f"| {cell['workload']['name']} T={cell['sampling']['temperature']:g} | {r['label']} | "
                         + " | ".join(f"{parts[p]:.3f}" for p in PHASES) + f" | {overhead:.2f} |")
    return lines + [""]


def host_sync_lines(result: dict) -> list[str]:
    """Host syncs per step (specdec/decoding/syncs.py) of every configuration, per cell: the points where the host
    waits for the device (reads) or hands it Python data (writes); on a GPU each one stalls the host."""
    lines = ["## Host syncs per step", "",
             f"Counted over one untimed generation of each cell's first batch, prefill included, divided by its "
             f"steps (specdec/decoding/syncs.py), on {result['conditions']['hardware']['device_used']}: reads of device values "
             "into Python + tensors made from Python data. Plain decoding: one step per token.", "",
             "| cell | method | reads | writes | total |", "|---|---|---|---|---|"]
    for cell in result["cells"]:
        for r in cell["results"]:
            syncs = r.get("host_syncs_per_step")
            if syncs:
                where = f"{cell['workload']['name']} T={cell['sampling']['temperature']:g} B={cell['batch_size']}"
                lines.append(f"| {where} | {r['label']} | {syncs['reads']:.1f} | {syncs['writes']:.1f} | "
                             f"{syncs['total']:.1f} |")
    return lines + [""]


def conditions_text(result: dict) -> str:
    c = result["conditions"]
    t, h, s = c["target"], c["hardware"], c["software"]
    parts = [f"target `{t['path']}` ({t['parameters'] / 1e6:.1f}M parameters, {t['dtype']}, sha256 "
             f"{t['checkpoint_sha256'][:12]}) on {t['backend']}"]
    parts += dict.fromkeys(filter(None, (DRAFTERS[name].condition(info) for name, info in c["drafters"].items())))
    features = " ".join(h["cpu_features"]) if isinstance(h["cpu_features"], list) else h["cpu_features"]
    parts += ["n-gram 3..1", f"{h['cpu']} ({h['cores']} cores, {h['threads']} threads, features {features}, torch "
              f"CPU capability {h['torch_cpu_capability']}; accelerator {h['accelerator']}, used: {h['device_used']})", f"python {s['python']}, torch {s['torch']}, transformers {s['transformers']}, "
              f"specdec {s['specdec']} ({s['git']})", f"{c['repeats']} interleaved repeats",
              f"baseline: {c['baseline']}"]
    return "conditions: " + "; ".join(parts)


LEARNED_DRAFTERS = tuple(name for name, d in DRAFTERS.items() if d.learned)


def drafter_comparison_lines(result: dict) -> list[str]:
    """The learned drafters side by side on the same target, per greedy batch-1 cell: what each cost
    to train (parameters, training tokens and seconds, from its metadata) and what it gives at its
    fastest k (α_i, τ, c, speedup)."""
    lines = []
    for cell in result["cells"]:
        if cell["sampling"]["temperature"] != 0 or cell["batch_size"] != 1:
            continue
        best = {}
        for r in cell["results"]:
            if r["method"] in LEARNED_DRAFTERS and (r["method"] not in best or
                                                    r["speedup"]["median"] > best[r["method"]]["speedup"]["median"]):
                best[r["method"]] = r
        if len(best) < 2:
            continue
        if not lines:
            lines = ["## Learned drafters on the same target", "",
                     "Each at its fastest k in the cell. Parameters: the drafter's own (an EAGLE head and MTP "
                     "heads also read the target's embedding; the draft model has its own); training tokens and "
                     "seconds: its training run as recorded in its metadata (the shipped draft model's distillation "
                     "run, which started from a pretrained draft).", "",
                     "| cell | drafter | parameters | training tokens | training s | best k | α_1..α_k | τ | c | "
                     "speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
        for method, r in best.items():
            info = r["conditions"]["method"]
            params = info["draft"]["parameters"] if "draft" in info else info["parameters"]
            tokens, seconds = info.get("training_tokens"), info.get("training_seconds")
            budget = (f"{tokens / 1e6:.2f}M | {seconds / 60:.0f} min"
                      if isinstance(tokens, int) and isinstance(seconds, (int, float)) else "unknown | unknown")
            lines.append(f"| {cell['workload']['name']} | {method} | {params / 1e6:.1f}M | {budget} | {r['k']} | "
                         f"{' '.join(num(a) for a in r['acceptance_per_position'])} | "
                         f"{num(r['mean_acceptance_length'])} | {num(r['draft_cost_ratio'])} | "
                         f"{r['speedup']['median']:.2f}x |")
    return lines + ([""] if lines else [])


def prediction_errors(result: dict) -> tuple[list[float], int]:
    """|prediction error| of every speculative configuration whose figures are not noisy, and
    how many noisy ones were left out."""
    rs = [r for cell in result["cells"] for r in cell["results"] if r["prediction_error"] is not None]
    return [abs(r["prediction_error"]) for r in rs if not r["noise"]], sum(1 for r in rs if r["noise"])


def summary_lines(result: dict) -> list[str]:
    lines = []
    errors, noisy = prediction_errors(result)
    left_out = f"; {noisy} noisy configurations left out" if noisy else ""
    if errors:
        lines.append(f"cost model: median |prediction error| {100 * statistics.median(errors):.0f}% "
                     f"(max {100 * max(errors):.0f}%) over {len(errors)} speculative configurations{left_out}")
    elif noisy:
        lines.append(f"cost model: no prediction error reported, all {noisy} speculative configurations are noisy")
    for b in result["batch_effect"]:
        by_batch = ", ".join(f"B={k}: {v:.2f}x" for k, v in b["speedup_by_batch"].items())
        first = min(b["speedup_by_batch"])
        verdict = ("pays at every batch size measured" if b["stops_paying_at"] is None
                   else "pays at no batch size measured" if b["stops_paying_at"] == first
                   else f"stops paying off at batch {b['stops_paying_at']}")
        lines.append(f"batch effect, {b['label']} ({b['workload']}, {b['prompts']} prompts, "
                     f"temperature {b['temperature']:g}): "
                     f"{by_batch} -> {verdict}")
    auto = auto_floor_line(result)
    if auto:
        lines.append(auto)
    differ = seeded_disagreements(result)
    if differ:
        lines.append(f"seeded and unseeded α DIFFER beyond noise: {'; '.join(differ)}")
    moe = result["moe"]
    if moe:
        rel = ", ".join(f"{n}: {m:.2f}/{d:.2f}" for n, m, d in zip(moe["tokens"], moe["moe_relative"],
                                                                   moe["dense_relative"]))
        lines.append(f"verify cost t(n)/t(1), MoE/dense of the same active size ({moe['spec']['num_experts']} experts, "
                     f"top-{moe['spec']['top_k']}, {moe['moe_parameters']['active'] / 1e6:.1f}M active, {moe['dtype']}): "
                     f"{rel}")
    return lines


def adaptive_lines(result: dict) -> list[str]:
    """Per cell and method: -k auto against plain decoding and the best fixed configuration."""
    lines = ["| cell | method | auto | best fixed (label) | auto / best | chosen (steps) |", "|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        for method in dict.fromkeys(r["method"] for r in cell["results"]):
            auto = next((r for r in cell["results"] if r["method"] == method and r["k"] == "auto"), None)
            fixed = [r for r in cell["results"] if r["method"] == method and r["k"] != "auto"]
            if auto is None:
                continue
            best = max(fixed, key=lambda r: r["speedup"]["median"]) if fixed else None
            versus = (f"{best['speedup']['median']:.2f}x ({best['label']}) | "
                      f"{auto['speedup']['median'] / best['speedup']['median']:.2f}") if best else "- | -"
            chosen = sorted(auto["adaptive"]["choices"].items(), key=lambda c: -c[1])[:4]
            lines.append(f"| {cell['workload']['name']} T={cell['sampling']['temperature']:g} B={cell['batch_size']} | "
                         f"{method} | {auto['speedup']['median']:.2f}x{' NOISY' if auto['noise'] else ''} | "
                         f"{versus} | {', '.join(f'{label} {n}' for label, n in chosen)} |")
    return lines if len(lines) > 2 else []


def cell_label(cell: dict) -> str:
    return f"{cell['workload']['name']} T={cell['sampling']['temperature']:g} B={cell['batch_size']}"


AUTO_FLOOR = 0.95  # -k auto's goal: at least this share of plain decoding's speed in every cell


def auto_floor_line(result: dict) -> str | None:
    """-k auto against plain decoding over every cell and method: the lowest median speedup and
    the configurations below AUTO_FLOOR (None without a -k auto configuration)."""
    autos = [(r["speedup"]["median"], f"{r['method']} ({cell_label(cell)})", r["noise"])
             for cell in result["cells"] for r in cell["results"] if r["k"] == "auto"]
    if not autos:
        return None
    below = [f"{name} {speedup:.2f}x{' NOISY' if noise else ''}" for speedup, name, noise in sorted(autos)
             if speedup < AUTO_FLOOR]
    lowest = min(autos)
    return (f"k=auto against plain decoding: lowest {lowest[0]:.2f}x ({lowest[1]}) over {len(autos)} configurations; "
            + (f"below {AUTO_FLOOR}x: {', '.join(below)}" if below else f"none below {AUTO_FLOOR}x"))


def seeded_lines(result: dict) -> list[str]:
    """Per sampling cell and method: α of the seeded repeats beside one unseeded generation."""
    lines = ["| cell | method | α seeded | α unseeded | difference (± standard error) | verdict |",
             "|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        for r in cell["results"]:
            u = r.get("unseeded_acceptance")
            if not u or u["difference"] is None:
                continue
            verdict = "agree" if u["agree"] else "DIFFER beyond noise"
            lines.append(f"| {cell['workload']['name']} T={cell['sampling']['temperature']:g} B={cell['batch_size']} | "
                         f"{r['label']} | {r['acceptance_rate']:.3f} ({r['counters']['proposed']}) | "
                         f"{u['acceptance_rate']:.3f} ({u['proposed']}) | {u['difference']:+.3f} "
                         f"(± {u['standard_error']:.3f}) | {verdict} |")
    return lines if len(lines) > 2 else []


def seeded_disagreements(result: dict) -> list[str]:
    """The configurations whose seeded and unseeded α differ beyond noise."""
    return [f"{r['label']} ({cell['workload']['name']} T={cell['sampling']['temperature']:g} B={cell['batch_size']}): "
            f"seeded {r['acceptance_rate']:.3f}, unseeded {r['unseeded_acceptance']['acceptance_rate']:.3f}"
            for cell in result["cells"] for r in cell["results"]
            if r.get("unseeded_acceptance") and r["unseeded_acceptance"]["agree"] is False]


def tree_lines(result: dict) -> list[str]:
    """Trees against the chain that verifies as many tokens per step, at batch 1, and what the
    cost model predicts for both on a flat verify curve (t(n) = t(1), as on hardware where a
    forward of a few tokens costs what one does): τ × t(1) / (t(1) + draft + other)."""
    lines = ["| cell | tree | verified tokens / step | τ tree / chain | speedup tree / chain | "
             "flat curve: tree / chain |", "|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        if cell["batch_size"] != 1:
            continue
        t1 = cell["verify_curve"]["seconds"][cell["verify_curve"]["tokens"].index(1)]
        for tree in (r for r in cell["results"] if r.get("widths") and r["counters"]):
            nodes = sum(tree["widths"])
            chain = next((r for r in cell["results"] if r["method"] == tree["method"] and r["k"] == nodes
                          and not r.get("widths") and r["counters"]), None)
            if chain is None:
                continue
            flat = [r["mean_acceptance_length"] * t1 / (t1 + r["seconds_per_step"]["draft"] +
                                                         r["seconds_per_step"]["other"]) for r in (tree, chain)]
            verified = 1 + tree["counters"]["proposed"] / tree["counters"]["row_steps"]
            lines.append(f"| {cell['workload']['name']} T={cell['sampling']['temperature']:g} | {tree['label']} "
                         f"(vs k={nodes}) | {verified:.1f} / {1 + nodes} | "
                         f"{tree['mean_acceptance_length']:.2f} / {chain['mean_acceptance_length']:.2f} | "
                         f"{tree['speedup']['median']:.2f}x / {chain['speedup']['median']:.2f}x | "
                         f"{flat[0]:.2f}x / {flat[1]:.2f}x |")
    return lines if len(lines) > 2 else []


def console_report(result: dict, out_dir: Path) -> str:
    lines = []
    for cell in result["cells"]:
        lines += ["", cell_heading(cell), *cell_table(cell)]
    lines += ["", conditions_text(result), *summary_lines(result),
              f"full report: {out_dir / REPORT_NAME} (JSON: {out_dir / JSON_NAME}, plots: {out_dir}/*.png); "
              f"{result['seconds'] / 60:.1f} min"]
    return "\n".join(lines)


def markdown_report(result: dict, plots: list[str]) -> str:
    """report.md; `plots`: the PNG files written (a plot with nothing to show is not)."""
    cmd = " ".join(result["command"]) if isinstance(result["command"], list) else result["command"]
    lines = ["# specdec bench", "", f"`{cmd}` — {result['seconds'] / 60:.1f} min.", "", reproduce_line(result), "",
             conditions_text(result), "",
             "Speedup = tokens/s of the method / tokens/s of specdec's plain decoding in the same repeat "
             "(median and range over repeats). α = accepted / proposed drafts, τ = tokens emitted per step "
             "including the recovered or bonus token (specdec/decoding/metrics.py). *predicted*: the cost model "
             "(specdec/decoding/costmodel.py) from α_i, the measured draft and bookkeeping seconds per step, the "
             "measured verify-cost curve and the generation's prefill per emitted token (the measured "
             "speedup is over whole generations).", ""]
    for cell in result["cells"]:
        lines += [f"## {cell_heading(cell)}", "", *cell_table(cell), "", *curve_lines(result, cell), ""]
    lines += marked("step-breakdown", step_breakdown_lines(result))
    lines += marked("host-syncs", host_sync_lines(result))
    lines += section("Adaptive speculation (-k auto)", "adaptive", adaptive_lines(result),
                     "Each method with `-k auto` (specdec/decoding/adaptive.py) against the best fixed k or tree of "
                     "the same cell, measured in the same repeats; *chosen*: the options it drafted, in steps "
                     "(plain: plain decoding).")
    lines += section("Seeded vs unseeded acceptance", "seeded", seeded_lines(result),
                     "Sampling cells run seeded (`--seed`): a seeded row's drafts are drawn with the noise its "
                     "verifier draws with (sampling.Draws), an unseeded row's from a generator, verified by rejection "
                     "sampling. Both must accept drafts alike; each method's first fixed-k chain ran once more "
                     "without a seed (untimed) to show it. α (proposed drafts); *DIFFER*: the difference exceeds "
                     "3 standard errors (each draft taken as an independent trial).")
    lines += section("Trees vs chains at equal verified tokens (batch 1)", "trees", tree_lines(result),
                     "A tree of N nodes against the chain of k = N drafts (both verify up to 1 + N tokens per step). "
                     "*flat curve*: the cost model with t(n) = t(1) (hardware where a forward of a few tokens costs "
                     "what one does): τ × t(1) / (t(1) + draft + other seconds per step, as measured here).")
    costs = ["| cell | method | α_1..α_k | c | draft / verify / other ms per step | predicted | measured | error | "
             "S_limit | efficiency |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        for r in cell["results"]:
            if r["predicted_speedup"] is None:
                continue
            ms = " / ".join(f"{1000 * r['seconds_per_step'][p]:.1f}" for p in ("draft", "verify", "other"))
            alphas = " ".join(num(a) for a in r["acceptance_per_position"])
            costs.append(f"| {cell['workload']['name']} T={cell['sampling']['temperature']:g} B={cell['batch_size']} | "
                         f"{r['label']} | {alphas} | {num(r['draft_cost_ratio'])} | {ms} | "
                         f"{r['predicted_speedup']:.2f}x | {r['speedup']['median']:.2f}x{' NOISY' if r['noise'] else ''} | "
                         f"{100 * r['prediction_error']:+.0f}% | {r['speedup_limit']:.2f} | {r['efficiency']:.2f} |")
    lines += ["## Cost model: predicted vs measured", "",
              *marked("cost-model", [*costs, "", *(f"- {line}" for line in summary_lines(result)), ""], heading=0)]
    lines += marked("drafters", drafter_comparison_lines(result))
    moe = result["moe"]
    if moe:
        p = moe["moe_parameters"]
        lines += ["## MoE vs dense verify cost", "",
                  f"Mixtral-style MoE ({moe['spec']['num_experts']} experts, top-{moe['spec']['top_k']}, "
                  f"{p['total'] / 1e6:.1f}M total, {p['active'] / 1e6:.1f}M active, experts implementation "
                  f"{moe['experts_implementation']}) vs a dense Llama of {moe['dense_parameters'] / 1e6:.1f}M, "
                  f"{moe['dtype']}, {moe['weights']}. Estimate: bandwidth-bound, expert bytes "
                  f"{100 * p['expert_fraction_of_bytes_read']:.0f}% of a 1-token forward, distinct experts "
                  "E(1 - (1 - r/E)^n).", "",
                  "| tokens n | MoE ms | dense ms | MoE t(n)/t(1) | dense t(n)/t(1) | estimate MoE t(n)/t(1) | "
                  "experts touched per layer |", "|---|---|---|---|---|---|---|"]
        for row in zip(moe["tokens"], moe["moe_seconds"], moe["dense_seconds"], moe["moe_relative"],
                       moe["dense_relative"], moe["moe_relative_estimate"], moe["distinct_experts_estimate"]):
            n, ms, ds, mr, dr, er, ex = row
            lines.append(f"| {n} | {1000 * ms:.1f} | {1000 * ds:.1f} | {mr:.2f} | {dr:.2f} | {er:.2f} | {ex:.1f} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{PLOTS[name][0]}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def reproduce_line(result: dict) -> str:
    """The command and the commit a report came from, so that it can be rerun."""
    cmd = " ".join(result["command"]) if isinstance(result["command"], list) else result["command"]
    sha = result["conditions"]["software"]["git"]
    dirty = " plus changes not yet committed when it ran (git: +dirty)" if sha.endswith("+dirty") else ""
    return f"Reproduce: `{cmd}` at specdec commit `{sha.removesuffix('+dirty')}`{dirty}."


def section(title: str, name: str, body: list[str], intro: str) -> list[str]:
    """A section of its own: the title, then, marked as `name`, the introduction and the body; nothing
    where the body is empty (the run measured nothing of it)."""
    if not body:
        return []
    return [f"## {title}", "", *marked(name, [intro, "", *body, ""], heading=0)]


def marked(name: str, lines: list[str], heading: int = 2) -> list[str]:
    """`lines` with snippet markers around them after their first `heading` lines (a section's title),
    so the docs can include the section from the report (pymdownx.snippets: "report.md:name")."""
    if not lines:
        return lines
    return [*lines[:heading], f"<!-- --8<-- [start:{name}] -->", "", *lines[heading:], "",
            f"<!-- --8<-- [end:{name}] -->", ""]


def write_report(result: dict, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / JSON_NAME).write_text(json.dumps(result, indent=1) + "\n")
    plots = write_plots(result, out_dir)
    (out_dir / REPORT_NAME).write_text(markdown_report(result, plots))
    return out_dir
