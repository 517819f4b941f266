"""transformers' own decoders as peers, on the same weights as specdec's target: `generate`
(plain decoding), assisted generation (`assistant_model=` the same draft model, where the run has
one) and prompt lookup (`prompt_lookup_num_tokens=k`, n-gram drafting). Batch 1 only: transformers' assisted generation
supports no larger batch. They run in bfloat16, transformers' fastest setting on this CPU (its
float32 path is slower: `specdec bench plain` measures both), so their arithmetic differs from
specdec's float32 and their outputs are checked against hf-generate, not against specdec.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..decoding.sampling import SamplingConfig
from ..errors import SpecdecError
from ..lm.gguf import checkpoint

PEERS = ("hf-generate", "hf-assisted", "hf-prompt-lookup")
PEER_DTYPE = torch.bfloat16


class Peers:
    def __init__(self, target_path: Path, draft_path: Path | None, dtype: torch.dtype, device: torch.device):
        """draft_path: the run's draft model (None: no assisted generation)."""
        import transformers

        self.version, self.dtype, self.device = transformers.__version__, dtype, device
        load = transformers.AutoModelForCausalLM.from_pretrained
        self.target, self.draft = (load(checkpoint(path), dtype=dtype).to(device).eval() if path else None
                                   for path in (target_path, draft_path))  # a .gguf: its converted folder
        for model in (self.target, self.draft):
            if model is not None:
                model.generation_config.eos_token_id = None   # exactly max_new_tokens, as specdec's runs
                model.generation_config.pad_token_id = 0
        self.methods = tuple(p for p in PEERS if p != "hf-assisted" or self.draft is not None)

    def info(self) -> dict:
        impl = f"transformers {self.version} ({str(self.dtype).removeprefix('torch.')}, {self.device})"
        info = {"hf-generate": {"name": "hf-generate", "implementation": f"{impl} generate, KV cache"},
                "hf-assisted": {"name": "hf-assisted", "implementation": f"{impl} assisted generation",
                                "assistant": "the draft model of this run", "num_assistant_tokens_schedule": "constant"},
                "hf-prompt-lookup": {"name": "hf-prompt-lookup", "implementation": f"{impl} prompt lookup decoding"}}
        return {method: info[method] for method in self.methods}

    def generate(self, method: str, k: int, batch: list[list[int]], max_new_tokens: int,
                 sampling: SamplingConfig) -> list[list[int]]:
        if len(batch) != 1:
            raise SpecdecError(f"transformers' peers run at batch size 1, got {len(batch)}")
        kw = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy)
        if not sampling.greedy:  # the same transform as specdec's: temperature only, no top-k / top-p
            kw.update(temperature=sampling.temperature, top_k=0, top_p=1.0)
        if method == "hf-assisted":
            kw.update(assistant_model=self.draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
        elif method == "hf-prompt-lookup":
            kw.update(prompt_lookup_num_tokens=k)
        ids = torch.tensor(batch, device=self.device)
        # transformers samples from torch's global generator: seed it, and give the caller's state back
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(sampling.seed or 0)
            return [self.target.generate(ids, **kw)[0, ids.shape[1]:].tolist()]
