"""`specdec generate`: one prompt completed by the target, printed as text, a stream or JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import SpecdecError, counted
from .common import (add_draft_arguments, add_sampling_arguments, add_target_arguments, add_threads_argument,
                     draft_plan, set_threads, torch_dtype)


def cmd_generate(args) -> None:
    from .. import inputs
    from ..api import generate, load
    from ..bench.workloads import humaneval_prompt

    given = [args.prompt is not None, args.prompt_file is not None, args.humaneval is not None]
    if sum(given) != 1:
        raise SpecdecError("give exactly one of --prompt TEXT, --prompt-file PATH (- for stdin) or --humaneval INDEX")
    if args.prompt_file is not None:
        args.prompt = read_prompt_file(args.prompt_file)
    prompt = inputs.prompts(args.prompt if args.prompt is not None else humaneval_prompt(args.humaneval))[0]
    if args.stream and args.json:
        raise SpecdecError("--stream prints the text as it comes, --json one object at the end: give one of them")
    inputs.sampling(args.temperature, args.top_k, args.top_p, args.seed)
    inputs.generation(args.max_new_tokens, args.stop)
    plan = draft_plan(args)
    set_threads(args.threads)
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device, quantize=args.quantize)
    proposer, k = plan.build(target)
    chat = [{"role": "user", "content": prompt}] if args.chat else None
    streaming = not args.json and (args.stream or sys.stdout.isatty())  # text as it is committed
    pending = [] if chat else [prompt]  # shown with the first piece: not at all when generate refuses

    def show(i: int, piece: str) -> None:
        write("".join(pending) + piece)
        pending.clear()
    result = generate(target, None if chat else prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      stop=tuple(args.stop), proposer=proposer, k=k if proposer is not None else None,
                      widths=args.tree, messages=chat, on_text=show if streaming else None,
                      special_tokens=args.special_tokens, heal=not args.no_heal, constraint=constraint_of(args),
                      skip_special_tokens=not args.keep_special_tokens)
    if args.json:
        print(json.dumps({"text": result.texts[0], "tokens": result.tokens[0],
                          "finish_reason": result.finish_reasons[0], "stats": result.stats}))
        return
    s = result.stats
    print("".join(pending) if streaming else result.texts[0] if chat else prompt + result.texts[0])
    print(f"\n--- {footer(s, k, args.temperature)}; target {target.path}; finish: {result.finish_reasons[0]}",
          file=sys.stderr)


def constraint_of(args):
    """The structured-output constraint of --json-schema FILE, --json-object, --regex R or
    --grammar FILE (at most one: argparse's group), or None."""
    from ..decoding.constraint import Constraint
    if args.json_schema is not None:
        return Constraint.json_schema(read_text(args.json_schema, "--json-schema"))
    if args.grammar is not None:
        return Constraint.grammar(read_text(args.grammar, "--grammar"))
    if args.regex is not None:
        return Constraint.regex(args.regex)
    return Constraint.json_object() if args.json_object else None


def read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecdecError(f"{option}: cannot read {path} ({e.strerror}); give a readable UTF-8 file") from None


def write(text: str) -> None:
    """Text to stdout at once (a stream's piece)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def read_prompt_file(path: str) -> str:
    """The prompt from a UTF-8 file, or standard input for "-"."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise SpecdecError(f"cannot read the prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecdecError(f"the prompt file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def footer(s: dict, k: int | str, temperature: float) -> str:
    """The one-line summary of a generation; a figure that does not exist (α with k = 0, where
    the JSON says null) is written n/a."""
    def fmt(x, spec=".2f", scale=1.0):
        return "n/a" if x is None else format(x * scale, spec)
    method = "plain decoding" if s["method"] == "plain" else (
        f"{s['method']} k={k}: acceptance rate {fmt(s['acceptance_rate'])}, "
        f"mean acceptance length {fmt(s['mean_acceptance_length'])} over {counted(s['steps'], 'step')}")
    policy = s.get("thread_policy") or {}
    others = policy.get("other_processes_cores")  # None until the auto policy has sampled the machine
    measuring = s.get("verify_curve_seconds")  # -k auto's first run on this machine: outside the timing too
    return (f"{counted(s['new_tokens'], 'token')} in {s['seconds']:.2f} s ({fmt(s['tokens_per_s'], '.1f')} tokens/s, "
            f"time to first token {fmt(s['time_to_first_token'], '.0f', 1000)} ms; loading "
            f"{fmt(s['load_seconds'], '.1f')} s"
            + (f", measuring the verify cost {measuring:.1f} s" if measuring else "")
            + f", not timed); {method}; {s['dtype']}, batch 1, temperature {temperature}, "
            + counted(s["threads"], "thread")
            + (f" (auto{'' if others is None else ', other processes used ' + counted(others, 'core')})"
               if policy.get("mode") == "auto" else ""))


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="complete a prompt with the target")
    add_target_arguments(g, quantize=True)
    g.add_argument("--prompt", help="text to continue")
    g.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file ('-': standard input)")
    g.add_argument("--chat", action="store_true",
                   help="the prompt is a user's message, rendered by the model's chat template; print the reply")
    g.add_argument("--humaneval", type=int, metavar="INDEX", help="use HumanEval prompt INDEX (0..163)")
    g.add_argument("--special-tokens", action="store_true",
                   help="special-token text in the prompt (e.g. <|im_start|>) stands for the special token "
                        "(default: it is text, as every entry point encodes it)")
    g.add_argument("--keep-special-tokens", action="store_true",
                   help="special tokens the model writes (e.g. <|fim_prefix|>) stay in the text (default: left "
                        "out; the token that ends the generation never is in it)")
    g.add_argument("--no-heal", action="store_true",
                   help="keep the tokens of a prompt ending in whitespace as they are (default: token healing: its "
                        "last token is backed off and the first generated token must extend the prompt's text)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    structured = g.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON Schema "
                            "(structured output; the grammar's forced tokens are drafted, docs/structured.md)")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this grammar (Lark, or GBNF)")
    add_sampling_arguments(g, 0.0, "0 = greedy", "seed of the sampling (default: a fresh random seed)")
    g.add_argument("--stop", nargs="*", default=[], help="stop strings (not included in the text)")
    g.add_argument("--json", action="store_true", help="print one JSON object, at the end")
    g.add_argument("--stream", action="store_true",
                   help="print the text as its tokens are committed (default: when standard output is a terminal)")
    add_draft_arguments(g)
    add_threads_argument(g)
    g.set_defaults(func=cmd_generate)

