"""A GGUF file as specdec runs it against transformers' own GGUF loading of the same file (its config
and every tensor dequantized by the `gguf` package, float32 arithmetic), greedy, prompt by prompt.

specdec runs the file twice: with the file's values in fp32 (each quantized matrix dequantized exactly,
through specdec's own reader and model: the dequantized model transformers computes), and as stored
(the default: the kernels multiply the blocks by activation rows rounded to int8 per block of 32, or of
256 for the K-quants, as llama.cpp rounds them to Q8_0 and Q8_K, so its greedy tokens part from the fp32
model's at its smaller top-2 gaps).
Per prompt: the prompt's ids (specdec's tokenizer from the metadata against transformers' GGUF
tokenizer; also for TEXTS, which are only tokenized: special-token markup, spaces, non-ASCII text),
then --tokens greedy tokens from each; the number of leading tokens equal to
transformers', and where they differ, transformers' top-2 logit gap at that position (below --tie: a
near-tie, the rounding of two float orders of summation). Also the config keys where transformers'
reading of the metadata differs from specdec's (specdec reads what llama.cpp reads). And speculative
greedy decoding (n-gram drafts, k=3) of the default run equals its plain greedy decoding. With
--llama-server, llama.cpp runs the same file too (its server, greedy, from the same prompt ids): how far
its tokens follow transformers', beside specdec's as-stored run (both round activations to 8 bits). Ends
with one JSON line; exits 1 where the fp32 run's tokens differ other than at a near-tie, the ids differ,
or speculation changes a token.

    python benchmarks/gguf_family_check.py --model gemma-3-270m-q4_k_m.gguf \
        [--llama-server LLAMA_BUILD/bin/llama-server]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx
import torch
from serve_head_to_head import llama_server

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a small village by the sea,", "Photosynthesis is the process by which"]
TEXTS = ["<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n",
         "  two spaces,\ttabs\n\n\nand ünïcödé 日本語 🙂 <|im_start|> </s>"]
COMPARED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "sliding_window", "layer_types", "query_pre_attn_scalar",
            "final_logit_softcapping", "tie_word_embeddings", "partial_rotary_factor")


def transformers_model(path: Path):
    """transformers' model and tokenizer of the file, as its own GGUF loading reads them (its config and
    the `gguf` package's dequantized tensors: what from_pretrained(..., gguf_file=...) loads, without
    the `accelerate` package that call asks for), in float32."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    keys = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    config = transformers.AutoConfig.for_model(keys.pop("model_type"), **keys)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()},
                                                strict=False)
    model.tie_weights()
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"transformers' reading of {path.name} does not fit its model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def config_differences(ours: dict, theirs) -> dict[str, tuple]:
    """{key: (specdec's, transformers')} where the two readings of the metadata differ."""
    out = {}
    for key in COMPARED:
        if key in ours and getattr(theirs, key, None) != ours[key]:
            out[key] = (ours[key], getattr(theirs, key, None))
    return out


@torch.no_grad()
def greedy_transformers(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens and, at each, the top-2 logit gap."""
    tokens, gaps, x = [], [], torch.tensor([ids])
    past = None
    for _ in range(n):
        out = model(x, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        top = logits.topk(2).values
        tokens.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
        x = torch.tensor([[tokens[-1]]])
    return tokens, gaps


def llama_greedy(server, ids: list[int], n: int) -> list[int]:
    """Up to n greedy tokens of llama-server (serve_head_to_head.Server) after the prompt ids (fewer where it
    stops at an end-of-generation token)."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True}
    return httpx.post(server.url + "/completion", json=body, timeout=300).json()["tokens"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="a .gguf file")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--tie", type=float, default=1e-3, help="a top-2 logit gap below this is a near-tie")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default four built-in ones)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary: its greedy tokens too")
    args = p.parse_args(argv)

    from specdec.api import load
    from specdec.decoding.engine import speculative_generate
    from specdec.decoding.reference import reference_generate
    from specdec.decoding.sampling import SamplingConfig
    from specdec.decoding.stopping import StopRule
    from specdec.lm import gguf
    from specdec.lm.gguf_blocks import load_as_stored
    from specdec.proposers import NgramProposer

    target = load(args.model)
    reader = gguf.open_file(args.model)
    stored_types = {t.tensor_type.name for t in reader.tensors} - {"F32"}
    models = {"fp32 values": load_as_stored(args.model, requantize={t: "F32" for t in stored_types}),
              "as stored": target.model}
    model, hf_tok = transformers_model(args.model)
    differences = config_differences(gguf.config_of(reader, args.model.name), model.config)
    print(f"{args.model.name}: specdec runs {target.model.abilities.backend}")
    for key, (mine, theirs) in differences.items():
        print(f"  config {key}: specdec {mine!r}, transformers {theirs!r}")
    rows, ok = [], True
    llama = None
    if args.llama_server:  # one slot, 2 threads
        llama = llama_server("llama-server", args.llama_server, str(args.model), [], 1, 2048, 2)
        if not llama.wait():
            raise SystemExit(f"llama-server did not start on {args.model.name}: {llama.error}")
    for text in TEXTS:
        ids, hf_ids = target.tokenizer.prefix + target.tokenizer.encode(text), hf_tok(text)["input_ids"]
        ok &= ids == hf_ids
        rows.append({"text": text, "ids_equal": ids == hf_ids})
        print(f"  {text[:40]!r:44} ids {'equal' if ids == hf_ids else 'DIFFER'} (tokenized only)")
    for prompt in args.prompt or PROMPTS:
        ids = target.tokenizer.prefix + target.tokenizer.encode(prompt)
        hf_ids = hf_tok(prompt)["input_ids"]
        expected, gaps = greedy_transformers(model, hf_ids, args.tokens)
        row = {"prompt": prompt, "ids_equal": ids == hf_ids, "tokens": args.tokens}
        print(f"  {prompt[:40]!r:44} ids {'equal' if ids == hf_ids else 'DIFFER'}")
        ok &= ids == hf_ids
        for run, ours in models.items():
            got = reference_generate(ours, ids, StopRule(args.tokens), SamplingConfig()).tokens
            if run == "as stored":
                spec_rows, metrics = speculative_generate(ours, NgramProposer(), [ids], StopRule(args.tokens),
                                                      SamplingConfig(), 3)
                same = spec_rows[0].tokens == got
                ok &= same
                row["speculation_equals_plain"] = same
                print(f"    n-gram speculation (k=3) {'equals' if same else 'DIFFERS FROM'} plain decoding "
                      f"({metrics.accepted} of {metrics.proposed} drafts accepted)")
            equal = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), args.tokens)
            tie = equal < args.tokens and gaps[equal] < args.tie
            if run == "fp32 values":
                ok &= equal == args.tokens or tie
            row[run] = {"equal_prefix": equal, "gap_at_divergence": None if equal == args.tokens else gaps[equal]}
            print(f"    {run:12} greedy tokens equal {equal}/{args.tokens}" + (
                "" if equal == args.tokens else f" (then top-2 gap {gaps[equal]:.2e}{', a near-tie' if tie else ''})")
                + f": {target.tokenizer.decode(got)!r}")
        if llama is not None:
            got = llama_greedy(llama, ids, args.tokens)
            equal = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))
            row["llama.cpp"] = {"equal_prefix": equal, "tokens": len(got),
                                "gap_at_divergence": None if equal == len(got) else gaps[equal]}
            print(f"    {'llama.cpp':12} greedy tokens equal {equal}/{len(got)}" + (
                "" if equal == len(got) else f" (then top-2 gap {gaps[equal]:.2e})"))
        rows.append(row)
    if llama is not None:
        llama.stop()
    print(json.dumps({"model": args.model.name, "backend": target.model.abilities.backend,
                      "config_differences": {k: list(v) for k, v in differences.items()}, "prompts": rows,
                      "agree": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
