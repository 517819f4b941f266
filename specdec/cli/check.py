"""`specdec check`: the statistical test that speculative decoding of a target and draft is lossless."""
from __future__ import annotations

import json

from ..errors import SpecdecError
from .common import (add_draft_arguments, add_sampling_arguments, add_target_arguments, add_threads_argument,
                     draft_plan, set_threads, torch_dtype)


def cmd_check(args) -> int:
    from .. import inputs
    from ..api import encode_prompts, load
    from ..bench.workloads import humaneval_prompts
    from ..check import WRONG_VERIFIERS, check
    from ..decoding.sampling import SamplingConfig

    inputs.sampling(args.temperature, args.top_k, args.top_p, args.seed)
    plan = draft_plan(args)
    if plan.name is None:
        raise SpecdecError("specdec check needs a draft: --draft draft-model --draft-model PATH (or ngram, mtp, "
                           "eagle, suffix)")
    set_threads(args.threads)
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    proposer, _ = plan.build(target)
    prompts = encode_prompts(target, args.prompt or humaneval_prompts(args.prompts), args.max_new_tokens)
    verify = {"sampled_verify": WRONG_VERIFIERS[args.wrong_verifier]} if args.wrong_verifier else {}
    k = args.k if args.k is not None else len(args.tree) if args.tree else 3
    result = check(target.model, proposer, prompts, SamplingConfig(args.temperature, args.top_k, args.top_p),
                   k=k, sequences=args.sequences,
                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed or 0,
                   widths=args.tree, **verify)
    if args.wrong_verifier:
        result.conditions["verifier"] = f"{args.wrong_verifier} (deliberately wrong: FAIL is the expected verdict)"
    print(json.dumps({"status": result.status, "passed": result.passed, "sampled": result.sampled,
                      "greedy": result.greedy, "conditions": result.conditions}) if args.json else result.verdict())
    return CHECK_EXIT[result.status]


CHECK_EXIT = {"PASS": 0, "FAIL": 1, "UNDECIDED": 3}  # 2: the check could not run (bad input, main's errors)


def add_check_parser(sub) -> None:
    ch = sub.add_parser("check", help="test that speculative decoding of your target and draft is lossless",
                        description="Samples continuations by speculative decoding and tests each token's randomized "
                                    "probability-integral transform under the target's own processed distribution "
                                    "(one target forward per sequence) for i.i.d. uniformity (Kolmogorov-Smirnov: a "
                                    "first run's p below 0.02 is followed by a second, independent run, and FAIL "
                                    "needs its p below 0.05 too: false-alarm rate 0.1%); and greedy output against "
                                    "plain decoding. Prints the verdict, the p-values, the false-alarm rate, the "
                                    "test's power and the conditions. Exit status: 0 PASS, 1 FAIL, 3 UNDECIDED (no "
                                    "draft was proposed), 2 the check could not run.")
    add_target_arguments(ch)
    add_draft_arguments(ch, k_default="3, or the --tree's depth: fixed, so that every step verifies drafts")
    ch.add_argument("--prompt", action="append",
                    help="a prompt (repeat for more; default: HumanEval's first --prompts)")
    ch.add_argument("--prompts", type=int, default=8, help="HumanEval prompts used without --prompt")
    ch.add_argument("--sequences", type=int, default=128, help="continuations sampled (taken from the prompts in turn)")
    ch.add_argument("--max-new-tokens", type=int, default=32, help="tokens per continuation (EOS does not stop it)")
    ch.add_argument("--batch-size", type=int, default=16, help="continuations decoded together")
    add_sampling_arguments(ch, 1.0, "sampling temperature (> 0)", "seed of the sampling and of the PIT (default 0)")
    ch.add_argument("--wrong-verifier", choices=["accept-always"],
                    help="run the check with a deliberately wrong verifier, to see it fail on your pair")
    ch.add_argument("--json", action="store_true", help="print one JSON object")
    add_threads_argument(ch)
    ch.set_defaults(func=cmd_check)

