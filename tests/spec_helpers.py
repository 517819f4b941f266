"""Tiny real models and oracles shared by the speculative-decoding tests (engine, sampling, HF)."""
from __future__ import annotations

import copy

import torch

from specdec.decoding.engine import plain_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm.arch import Arch
from specdec.lm.device import placement
from specdec.lm.model import LlamaForCausalLM
from specdec.train.objectives import init_weights

# float32: a k-token forward may differ from a 1-token forward in the last bits, so a greedy
# divergence is accepted only where the target's top-2 logits are closer than this.
NEAR_TIE = 1e-4


def tiny_llama(seed: int, vocab: int = 64, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
               context: int = 64, std: float = 0.2) -> LlamaForCausalLM:
    """A random float32 Llama; std larger than training init so distributions are peaked."""
    torch.manual_seed(seed)
    cfg = Arch(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
               max_position_embeddings=context)
    model = LlamaForCausalLM(cfg)
    init_weights(model, std=std)
    return model.eval()


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """The model with Gaussian noise on every weight: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


def own_continuations(target) -> tuple[torch.Tensor, torch.Generator]:
    """Training data for a draft head of `target`: 48 random 3-token prompts continued by the target
    itself, greedily and at temperature 1, 29 tokens each: (96, 32), and the generator it drew from
    (seeded 0; the caller keeps drawing from it)."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.config.vocab_size, (48, 3), generator=g).tolist()
    data = []
    for temperature in (0.0, 1.0):
        rows, _ = plain_generate(target, prompts, StopRule(29), SamplingConfig(temperature), g)
        data += [p + r.tokens for p, r in zip(prompts, rows)]
    return torch.tensor(data), g


@torch.no_grad()
def greedy_divergence(target, prompt: list[int], got: list[int], expected: list[int]) -> float | None:
    """None when `got` equals `expected`; else the target's top-2 logit gap at the first position
    where they differ (computed like the reference: a full forward over prompt + common prefix)."""
    if got == expected:
        return None
    j = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    logits = target(torch.tensor([prompt + expected[:j]], device=placement(target).device)).logits[0, -1]
    top2 = logits.float().topk(2).values
    return float(top2[0] - top2[1])


def assert_greedy_rows_equal_reference(target, prompts: list[list[int]], rows, rule: StopRule) -> None:
    """Each row's tokens equal the reference decoder's greedy output for its prompt, or diverge where
    the target's top-2 logits are closer than NEAR_TIE."""
    for prompt, row in zip(prompts, rows):
        expected = reference_generate(target, prompt, rule, SamplingConfig()).tokens
        gap = greedy_divergence(target, prompt, row.tokens, expected)
        assert gap is None or gap < NEAR_TIE, (prompt, row.tokens, expected)
