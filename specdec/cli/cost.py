"""`specdec calibrate` and `specdec simulate`: the verify cost measured on this machine, and the
speedup the cost model predicts from it."""
from __future__ import annotations

import json
import sys

from ..errors import SpecdecError
from .common import add_target_arguments, add_threads_argument, set_threads, torch_dtype


def cmd_calibrate(args) -> None:
    from ..api import load
    from ..bench.conditions import hardware
    from ..decoding.calibration import cached_verify_curve, machine, write_curve_file
    from ..lm.checkpoint import shown_path

    set_threads(args.threads)
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    curves = {}
    for batch in args.batch_sizes:
        curve, _ = cached_verify_curve(target.admitted, batch, args.max_tokens, remeasure=True,
                                       points=list(range(1, args.max_tokens + 1)))
        curves[batch] = curve.seconds
        row = "  ".join(f"t({n})={1000 * s:.3f}" for n, s in sorted(curve.seconds.items()))
        print(f"batch {batch}: {row} ms")
    print(f"stored for -k auto on this machine: {json.dumps(machine())}, {target.admitted.abilities.backend}")
    if args.out:
        write_curve_file(args.out, curves, shown_path(target.path), target.admitted.abilities.backend,
                         hardware(target.admitted.device))
        print(f"written to {args.out} (specdec simulate --verify-curve {args.out} predicts from it)")


def add_calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="measure the target's verify-cost curve on this machine for -k auto",
                       description="Re-measure t(n), the seconds of one target forward over n tokens per row, at "
                                   "each batch size, and store it where -k auto reads it (it measures once by "
                                   "itself on first use; run this on a quiet machine after a change).")
    add_target_arguments(c)
    c.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16], help="batch sizes (default 1 4 16)")
    c.add_argument("--max-tokens", type=int, default=14, help="tokens per row measured, every n up to this "
                                                              "(default 14: the widest window of -k auto)")
    c.add_argument("--out", help="also write the curves to this JSON file, with their conditions (for "
                                 "`specdec simulate --verify-curve`: a prediction for that hardware)")
    add_threads_argument(c)
    c.set_defaults(func=cmd_calibrate)


def cmd_simulate(args) -> None:
    from .. import inputs
    from ..bench.noise import implausible_verify_points
    from ..decoding.calibration import read_curve_file
    from ..decoding.costmodel import VerifyCurve, moe_curve, predictions

    inputs.simulate(args.alpha, args.alpha_per_position, args.ks, args.draft_cost, args.batch_size, args.verify_ms,
                    args.verify_tokens, args.moe_experts, args.moe_top_k, args.expert_fraction)
    if args.verify_curve is not None:
        if args.verify_ms is not None:
            raise SpecdecError("give the verify curve once: --verify-curve FILE or --verify-ms values")
        curve, source = read_curve_file(args.verify_curve, args.batch_size)
        needed = 1 + (len(args.alpha_per_position) if args.alpha_per_position else max(args.ks))
        if max(curve.seconds) < needed:
            raise SpecdecError(f"{args.verify_curve} reaches {max(curve.seconds)} tokens per row at batch "
                               f"{args.batch_size}, but k + 1 = {needed} are needed: calibrate with a larger "
                               "--max-tokens")
    elif args.verify_ms is not None:
        tokens = args.verify_tokens or list(range(1, len(args.verify_ms) + 1))
        curve = VerifyCurve({n: ms / 1000 for n, ms in zip(tokens, args.verify_ms)})
        source = "the verify curve given on the command line (target and hardware: unknown)"
    else:
        from ..api import load
        from ..bench.conditions import hardware
        from ..decoding.calibration import measure_verify_curve

        set_threads(args.threads)
        target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
        ks_needed = len(args.alpha_per_position) if args.alpha_per_position else max(args.ks)
        curve = measure_verify_curve(target.admitted, list(range(1, args.batch_size * (ks_needed + 1) + 1)))
        h = hardware()
        source = (f"the verify curve of target {target.name} measured now with "
                  f"{target.admitted.abilities.backend}"
                  + (f", on {h['cpu']}, {h['threads']} threads" if args.device == "cpu" else ""))
    if args.moe_experts is not None:
        curve = moe_curve(curve, args.moe_experts, args.moe_top_k, args.expert_fraction)
        source += (f", as an MoE target ({args.moe_experts} experts, top-{args.moe_top_k}, expert bytes "
                   f"{args.expert_fraction:.0%} of a 1-token forward)")
    chains = [list(args.alpha_per_position)] if args.alpha_per_position else [[args.alpha] * k for k in args.ks]
    print("| k | E (tokens per step) | t_verify(B(k+1)) / t_verify(B) | draft / t_verify(B) | predicted speedup | "
          "S_limit (free draft) | break-even α |")
    print("|---|---|---|---|---|---|---|")
    for p in predictions(chains, args.draft_cost, curve, args.batch_size):
        even = "never" if p.break_even is None else f"{p.break_even:.2f}"
        print(f"| {p.k} | {p.tokens_per_step:.2f} | {p.verify_ratio:.2f} | {p.draft_ratio:.2f} | {p.speedup:.2f}x | "
              f"{p.limit:.2f}x | {even} |")
    acceptance = (f"i.i.d. α = {args.alpha}" if args.alpha is not None
                  else f"α_i = {' '.join(map(str, args.alpha_per_position))}")
    print(f"\npredicted, not measured: a chain of k drafts, acceptance {acceptance}, draft cost "
          f"{args.draft_cost} x t_verify(1 token) per drafted token, batch {args.batch_size}, sampling and "
          f"workload as the acceptance was measured; from {source}. S_limit = E x t(1)/t(k+1).")
    implausible = implausible_verify_points(curve.seconds)
    if implausible:
        points = ", ".join(f"n={n}: {r:.2f}x" for n, r in implausible)
        cause = ("check the --verify-ms values." if args.verify_ms is not None else "the machine was busy while "
                 "measuring. Rerun on a quiet machine, or give --verify-ms.")
        print(f"warning: noisy verify curve, the predictions above are not trustworthy: t(n) against the dearest "
              f"smaller n (for a spike: against the dearest larger n) is {points}, but a forward over more tokens "
              f"cannot cost much less than over fewer; {cause}", file=sys.stderr)


def add_simulate_parser(sub) -> None:
    s = sub.add_parser("simulate", help="predict speculative decoding's speedup with the cost model",
                       description="Predicted speedup = E x t_verify(1) / (t_draft + t_verify(k+1)), with E from "
                                   "the acceptance and t_verify the measured verify-cost curve.")
    s.add_argument("--alpha", type=float, help="i.i.d. acceptance rate α (sweeps --ks)")
    s.add_argument("--alpha-per-position", nargs="+", type=float, help="measured α_1..α_k (k = their count)")
    s.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8], help="draft lengths with --alpha")
    s.add_argument("--draft-cost", type=float, default=0.0,
                   help="draft seconds per drafted token / target 1-token forward (n-gram ~0, a draft model ~0.1-0.5)")
    s.add_argument("--batch-size", type=int, default=1, help="rows verified together per step")
    s.add_argument("--verify-ms", nargs="+", type=float,
                   help="the verify curve: ms of a target forward over --verify-tokens tokens (default: measure "
                        "the target now)")
    s.add_argument("--verify-tokens", nargs="+", type=int, help="tokens of each --verify-ms point (default 1, 2, ...)")
    s.add_argument("--verify-curve", metavar="FILE", help="the verify curve of `specdec calibrate --out FILE` "
                                                          "(measured on other hardware, a GPU say), at --batch-size")
    add_target_arguments(s, about="target to measure the curve on, a folder or .gguf file")
    s.add_argument("--moe-experts", type=int, help="estimate an MoE target with this many experts per layer")
    s.add_argument("--moe-top-k", type=int, default=2, help="experts per token (MoE estimate)")
    s.add_argument("--expert-fraction", type=float, default=0.6,
                   help="share of a 1-token forward's weight bytes that are expert weights (MoE estimate)")
    add_threads_argument(s)
    s.set_defaults(func=cmd_simulate)

