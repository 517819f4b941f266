"""The fast path of a cached forward (rows of equal length and one new token: no mask) gives the
logits of the general path (rows of different lengths: a mask) and of a forward without a cache."""
from __future__ import annotations

import torch

from ..conftest import tiny_model

TOL = 1e-5  # fp32: only the summation order may differ


@torch.inference_mode()
def test_equal_and_unequal_length_rows_give_the_uncached_logits():
    model = tiny_model()
    seq = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    full = model(seq).logits[0]                                        # (30, V)
    other = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    for prompt_lengths in ([20, 20], [20, 13]):                        # equal lengths, then unequal
        cache = model.new_cache(2, 64)
        prompts = torch.cat([seq, other])[:, :20]
        model(prompts, cache=cache)
        cache.rollback(torch.tensor(prompt_lengths))
        n = prompt_lengths[0]
        for width in (1, 4, 1, 3):                                     # decode and verify steps
            step = torch.cat([seq[:, n:n + width], other[:, :width]])
            logits = model(step, cache=cache).logits[0]
            torch.testing.assert_close(logits, full[n:n + width], atol=TOL, rtol=0)
            n += width
