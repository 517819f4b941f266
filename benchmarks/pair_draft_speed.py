"""The Qwen2.5-Coder pair as stored (`--quantize gguf`): resident memory against the files' sizes, and
draft-model speculation against plain decoding, side by side (docs/quantized.md, "Where the pair stands").

    specdec pair install
    python benchmarks/pair_draft_speed.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b [--prompts 3] [--new-tokens 64]
        [--variants full,vocab,stop,hybrid] [--requantize Q5_0=Q4_1] [--lookup suffix,ngram]

Loads the target (resident memory then) and the draft, which drafts in the `--variants` asked for
(VARIANTS), each with `-k auto` (or -k N): over the full vocabulary (full), over the draft vocabulary
the cost model picks (vocab: `draft_vocab="auto"`, draft_model.chosen_vocab; the token counts made once
from local text, lm/local_counts), that with its chains stopped after a draft it is unsure of (stop:
`stop_below`), that with the vocabulary counted from code and prose only, as before the chat part
(stop-code-prose), and that drafting with a copy of the draft whose matrices of some types are rounded
into others at load (stop-requantized: `--requantize Q5_0=Q4_1,...`, gguf.raw_tensors), and that behind
suffix lookup, drafting only for the steps lookup finds nothing (hybrid: proposers/hybrid.py).
`--lookup` adds lookup drafters (ngram, suffix: no network, drafts from the text so far) at the same k,
as the registry makes them. One step's forward of the target and of each draft is timed first
(interleaved, the least of 15). Then, per workload (HumanEval greedy; chat at T=1, seeded: coupled
drafts), rounds of every decoder on every prompt in turn (interleaved, so a busier moment hits them
all): tokens/s of the decoding (a request's time less a one-token request's: the prompt's encoding
excluded), α (accepted / drafted), the draft's seconds per drafted token, the cost model's predicted
speedup (`-k auto`'s, of what it chose) and whether every output is plain decoding's, token for token.
Each round starts the suffix tries afresh (`forget`): a prompt's earlier round is never looked up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdec import api, kernels
from specdec.bench.workloads import CHAT_PROMPTS, humaneval_prompts
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm import local_counts, packaged
from specdec.lm.gguf_blocks import load_as_stored
from specdec.proposers.draft_model import DraftModelProposer, chosen_vocab, stored_bytes
from specdec.proposers.drafters import DraftModelOptions, drafter


def memory() -> str:
    """This process's resident memory now and at its peak (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return f"resident {fields['VmRSS'].strip()}, peak {fields['VmHWM'].strip()}"


def chosen_prediction(summary: dict) -> float:
    """`-k auto`'s predicted speedup over plain decoding of what it chose, weighted by the steps
    it chose each option for (adaptive.Adaptive.summary)."""
    choices = summary["choices"]
    return sum(n * summary["predicted_speedup"][option] for option, n in choices.items()) / sum(choices.values())


def step_times(target, decoders: dict, repeats: int = 15) -> None:
    """Milliseconds of one decoding step's forward, after 64 cached tokens: the target's, and each
    draft's (its unembedding over its draft vocabulary); interleaved, the least of `repeats`."""
    context = torch.arange(1000, 1064)[None] % target.model.config.vocab_size
    steps = {"target": (target.model, None)}
    steps.update({name: (proposer.model, None if proposer.vocab is None else proposer.vocab.unembedding)
                  for name, (proposer, _) in decoders.items() if isinstance(proposer, DraftModelProposer)})
    times = {name: [] for name in steps}
    with torch.inference_mode():
        caches = {}
        for name, (model, _) in steps.items():
            caches[name] = model.new_cache(1, 80)
            model(context, cache=caches[name])
        for _ in range(repeats):
            for name, (model, unembedding) in steps.items():
                t0 = time.perf_counter()
                model(context[:, -1:], cache=caches[name], **({} if unembedding is None else
                                                              {"unembedding": unembedding}))
                times[name].append(time.perf_counter() - t0)
                caches[name].rollback([64])
    print("one step's forward (least of %d, ms): " % repeats + ", ".join(
        f"{name} {1e3 * min(v):.1f}" for name, v in times.items()), flush=True)


def forget(decoders: dict) -> None:
    """A fresh suffix trie (suffix lookup's, the hybrid's) for each round: its shared trie learns from
    the other prompts' outputs, as a server's would, never from a prompt's own earlier round (the same
    seed decodes the same answer again: that would be memorising it)."""
    for proposer, _ in decoders.values():
        if hasattr(proposer, "forget"):
            proposer.forget()


VARIANTS = {  # name -> (draft vocabulary, stop below, counts of the parts, requantized)
    "full": (None, False, None, False), "vocab": ("auto", False, None, False), "stop": ("auto", True, None, False),
    "stop-code-prose": ("auto", True, ("code", "prose"), False), "stop-requantized": ("auto", True, None, True),
    "hybrid": ("auto", True, None, False)}  # stop's, behind suffix lookup


def draft_decoders(target, draft: str, variants: list[str], stop_below: float, requantize: dict, k) -> dict:
    """{label: (proposer, k)} of each variant (VARIANTS) of the draft model, sharing one network (and
    one requantized network, where a variant asks for one)."""
    kind = drafter("draft-model")
    network = kind.network(target, kind.folder(draft, target))  # one draft model, shared
    print(f"{draft} loaded; {memory()}", flush=True)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    smaller = None
    if any(VARIANTS[v][3] for v in variants):
        t0 = time.time()
        smaller = load_as_stored(packaged.resolve(draft), requantize=requantize)
        print(f"{draft} requantized ({requantize}) in {time.time() - t0:.0f} s: "
              f"{stored_bytes(network.model) / 1e6:,.0f} -> {stored_bytes(smaller) / 1e6:,.0f} MB of matrices; "
              f"{memory()}", flush=True)
    decoders = {}
    for variant in variants:
        vocab, stop, parts, requantized = VARIANTS[variant]
        options = DraftModelOptions(draft_vocab=vocab, stop_below=stop_below if stop else None)
        proposer = drafter(variant if variant == "hybrid" else "draft-model").proposer(network, target, options)
        if parts is not None or requantized:
            model = smaller if requantized else network.model
            counts = (network.token_counts if parts is None else
                      local_counts.token_counts(target.tokenizer.tok, model.config.vocab_size, parts))
            proposer = DraftModelProposer(model, chosen_vocab(model, target.model, counts), counts,
                                          stop_below=options.stop_below)
        ids = (proposer.model if variant == "hybrid" else proposer).draft_ids
        label = "hybrid: suffix, else draft-model, stop" if variant == "hybrid" else f"draft-model, {variant}"
        print(f"{label}: {'full vocabulary' if ids is None else f'{len(ids):,} ids'}; {memory()}", flush=True)
        decoders[label] = (proposer, k)
    return decoders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--draft")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="humaneval,chat")
    p.add_argument("--stop-below", type=float, default=0.3)
    p.add_argument("-k", default="auto", help="drafts per step: auto (the cost model's) or a number")
    p.add_argument("--variants", default="full,vocab,stop",
                   help=f"the draft model's decoders, of {', '.join(VARIANTS)}")
    p.add_argument("--lookup", default="", help="lookup drafters beside the draft model: ngram, suffix")
    p.add_argument("--requantize", default="Q5_0=Q4_1",
                   help="for the requantized variant: GGML types rounded into others at load, TYPE=TYPE,...")
    args = p.parse_args()
    t0 = time.time()
    target = api.load(args.model, quantize="gguf")
    size = os.path.getsize(packaged.resolve(args.model))
    print(f"{args.model}: loaded in {time.time() - t0:.0f} s; file {size / 1e6:,.0f} MB; {memory()}; weights "
          f"{api.weights_format(target)}; {kernels.quant_isa()}", flush=True)
    decoders = {"plain": (None, 0)}
    k = args.k if args.k == "auto" else int(args.k)
    if args.draft:
        decoders.update(draft_decoders(target, args.draft, args.variants.split(","), args.stop_below,
                                       dict(pair.split("=") for pair in args.requantize.split(",") if pair), k))
        step_times(target, decoders)
    decoders.update({name: (api.load_drafter(target, name), k) for name in args.lookup.split(",") if name})
    workloads = {"humaneval greedy": (humaneval_prompts(args.prompts), False, SamplingConfig()),
                 "chat T=1 seeded": (list(CHAT_PROMPTS[:args.prompts]), True, SamplingConfig(1.0, seed=0))}
    for workload, (texts, chat, sampling) in workloads.items():
        if workload.split()[0] not in args.workloads.split(","):
            continue
        prompts = api.encode_prompts(target, texts, args.new_tokens, chat=chat)

        def run(proposer, k, prompt, n):
            t0 = time.perf_counter()
            rows, metrics = speculative_generate(target.model, proposer, [prompt], StopRule(n), sampling, k)
            return rows[0].tokens, time.perf_counter() - t0, metrics

        for proposer, k in decoders.values():  # warm-up, not timed: -k auto's verify curve, the kernels
            run(proposer, k, prompts[0], 8)
        results = {name: [] for name in decoders}
        outputs = {}
        for r in range(args.rounds):
            forget(decoders)
            for i, prompt in enumerate(prompts):
                for name, (proposer, k) in decoders.items():
                    _, first, _ = run(proposer, k, prompt, 1)
                    tokens, seconds, m = run(proposer, k, prompt, args.new_tokens)
                    outputs.setdefault((name, i), tokens)
                    assert outputs[name, i] == tokens, f"{name} changed its output between rounds"
                    predicted = chosen_prediction(m.adaptive) if m.adaptive else 1.0
                    results[name].append((r, len(tokens) - 1, seconds - first, m.accepted, m.proposed,
                                          m.propose_seconds, predicted))
                print(f"{workload} round {r + 1}/{args.rounds} prompt {i}: " + ", ".join(
                    f"{name} {v[-1][1] / v[-1][2]:.2f}" for name, v in results.items()) + " tok/s", flush=True)
        speed = {name: statistics.median(sum(t for q, t, *_ in v if q == r) / sum(s for q, _, s, *_ in v if q == r)
                                         for r in range(args.rounds)) for name, v in results.items()}
        print(f"\n{workload}, {len(prompts)} prompts x {args.new_tokens} tokens, median of {args.rounds} rounds; "
              f"{memory()}; load average {os.getloadavg()[0]:.1f}")
        print("| decoder | tokens/s | vs plain | predicted (cost model) | α (accepted / drafted) | "
              "draft ms per drafted token | identical to plain |")
        print("|---|---|---|---|---|---|---|")
        for name, v in results.items():
            accepted, proposed, drafting = (sum(x[i] for x in v) for i in (3, 4, 5))
            same = all(outputs[name, i] == outputs["plain", i] for i in range(len(prompts)))
            print(f"| {name} | {speed[name]:.2f} | {speed[name] / speed['plain']:.2f}x | "
                  f"{statistics.median(x[6] for x in v):.2f}x | "
                  f"{accepted / max(proposed, 1):.2f} ({accepted} / {proposed}) | "
                  f"{1e3 * drafting / max(proposed, 1):.1f} | {same} |")
        print(flush=True)


if __name__ == "__main__":
    main()
