"""The Python API: token healing of prompts ending in whitespace (greedy output checked against
the reference decoder, speculative against plain), no global random state touched, the MTP
proposer's default k, a transformers model as a loaded target, and one-time setup at load."""
from __future__ import annotations

import re

import pytest
import torch
import transformers

from specdec import kernels
from specdec.api import Loaded, generate, load
from specdec.decoding.pipeline import encode
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import hf_config, sha256
from specdec.lm.tokenizer import EOS_ID
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.heads.mtp import build_mtp, save_mtp
from specdec.train.objectives import init_weights

from .conftest import TINY

INDENTED = "def f(x):\n    "


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return load(tiny_checkpoint)


def test_a_prompt_ending_in_whitespace_is_healed_not_stripped(target):
    prompt = encode(target.tokenizer, INDENTED)
    ids, healed = prompt.ids[len(target.tokenizer.prefix):], prompt.healed
    assert healed and INDENTED.endswith(healed)
    assert target.tokenizer.decode(ids) + healed == INDENTED
    result = generate(target, INDENTED, max_new_tokens=12)
    first = result.tokens[0][0]
    assert target.tokenizer.token_bytes[first].startswith(healed.encode())
    # the completion extends the prompt exactly: prompt + text is the decoded token sequence
    assert INDENTED + result.texts[0] == target.tokenizer.decode(ids + result.tokens[0])
    assert result.stats["healed_prompts"] == 1
    assert result.stats["prompt_tokens"] == [1 + len(target.tokenizer.encode(INDENTED))]


def test_healed_greedy_output_is_the_constrained_argmax_then_the_reference(target):
    prompt = encode(target.tokenizer, INDENTED)
    prefix, healed = prompt.ids, prompt.healed
    logits = target.model(torch.tensor([prefix])).logits[0, -1]
    allowed = [i for i, b in enumerate(target.tokenizer.token_bytes) if b and b.startswith(healed.encode())]
    first = max(allowed, key=lambda i: logits[i].item())
    rest = reference_generate(target.model, prefix + [first], StopRule(11, EOS_ID), SamplingConfig())
    result = generate(target, INDENTED, max_new_tokens=12)
    assert result.tokens[0] == [first, *rest.tokens]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_of_healed_prompts_equals_plain(target, k, temperature):
    prompts = [INDENTED, "import os\n", "x = 1"]  # healed, healed, not healed: one batch
    seed = 7 if temperature else None
    plain = generate(target, prompts, max_new_tokens=10, temperature=temperature, seed=seed)
    spec = generate(target, prompts, max_new_tokens=10, temperature=temperature, seed=seed,
                    proposer=NgramProposer(), k=k)
    assert spec.tokens == plain.tokens and spec.texts == plain.texts
    assert all(len(t) == 10 for t in plain.tokens) and plain.stats["healed_prompts"] == 2


def test_a_healed_prompt_is_prefilled_once(target, monkeypatch):
    """Healing restricts the first token of the forward that decodes it: the target reads the
    prompt in one forward (the engine's prefill), then one new token per forward."""
    windows = []
    forward = type(target.model).forward

    def counted(model, tokens, *args, **kwargs):
        windows.append(tokens.shape[1])
        return forward(model, tokens, *args, **kwargs)

    monkeypatch.setattr(type(target.model), "forward", counted)
    result = generate(target, INDENTED, max_new_tokens=6)
    prompt = encode(target.tokenizer, INDENTED)
    assert result.stats["healed_prompts"] == 1
    assert windows == [len(prompt.ids) - 1] + [1] * 6


def test_generate_never_touches_the_global_random_generator(target):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    generate(target, "def f(x):", max_new_tokens=4)                        # greedy, seed None
    generate(target, "def f(x):", max_new_tokens=4, temperature=1.0)       # sampling, seed None
    generate(target, "def f(x):", max_new_tokens=4, temperature=1.0, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_the_mtp_proposers_default_k_is_its_number_of_heads(tmp_path, tiny_checkpoint, target):
    heads = build_mtp("mtp-parallel", TINY, 2)
    init_weights(heads)
    save_mtp(heads, tmp_path / "heads", sha256(tiny_checkpoint / "model.safetensors"), dtype=torch.float32)
    from specdec.api import load_drafter
    mtp = load_drafter(target, "mtp", tmp_path / "heads")
    result = generate(target, "def f(x):", max_new_tokens=8, proposer=mtp)
    assert result.stats["k"] == 2
    assert result.tokens == generate(target, "def f(x):", max_new_tokens=8).tokens


def test_a_transformers_model_as_a_loaded_target_gets_its_stats(target):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(TINY, torch.float32)))
    hf.load_state_dict(target.model.hf_state_dict())
    wrapped = Loaded(hf.eval(), target.tokenizer, target.path)
    ours = generate(target, "def f(x):", max_new_tokens=8)
    theirs = generate(wrapped, "def f(x):", max_new_tokens=8)
    assert theirs.tokens == ours.tokens
    assert theirs.stats["dtype"] == "float32" and theirs.stats["load_seconds"] is None


def test_load_does_the_one_time_setup_and_records_its_seconds(tiny_checkpoint):
    kernels.compiled.cache_clear()
    loaded = load(tiny_checkpoint)
    assert kernels.compiled.cache_info().currsize == 1  # built or loaded inside load, not in generate
    assert loaded.load_seconds > 0
    assert generate(loaded, "x", max_new_tokens=2).stats["load_seconds"] == loaded.load_seconds


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([], {}, "no prompts given"),
    (None, {}, "must be a string or a list"),
    (b"def f():", {}, "not bytes"),
    (["ok", None], {}, "prompt 1 must be text"),
    ("abc\udcff\udcfedef", {}, "not valid UTF-8 text (bytes ff fe"),
    ("x", {"k": 3}, "needs a proposer"),
    ("x", {"temperature": float("nan")}, "temperature must be a finite number"),
    ("x", {"temperature": float("inf")}, "temperature must be a finite number"),
    ("x", {"temperature": 2.4e-96}, "temperature must be 0 (greedy) or in [0.0001, inf)"),  # found by the fuzz test
    ("x", {"top_k": 2.5}, "top_k must be an integer"),
    ("x", {"seed": -1}, "seed must be in 0.."),
    ("x", {"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ("x", {"stop": "\n"}, "not one string"),
])
def test_bad_api_input_is_a_clear_error(target, prompts, kwargs, message):
    with pytest.raises(SpecdecError, match=re.escape(message)):
        generate(target, prompts, max_new_tokens=kwargs.pop("max_new_tokens", 4), **kwargs)


def test_the_first_auto_run_measures_the_verify_cost_once_outside_its_timing(tiny_checkpoint, tmp_path,
                                                                             monkeypatch, capsys):
    """-k auto needs this machine's verify curve of the model: the first run measures it before its
    timed region (the figures exclude it, stats says how long it took), says so once on stderr with
    a progress bar; the next run reads it from the disk cache."""
    import time
    target = load(tiny_checkpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no curve measured before (set after the kernels load)
    t0 = time.perf_counter()
    first = generate(target, "def f(x):", max_new_tokens=16, proposer=NgramProposer(), k="auto").stats
    wall = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert err.count(f"measuring this machine's verify cost for {tiny_checkpoint.name}, once, ~") == 1
    assert "verify cost:" in err                                            # the progress bar
    assert first["verify_curve_seconds"] > 0
    assert first["seconds"] + first["verify_curve_seconds"] <= wall         # two intervals, one after the other
    second = generate(target, "def g(y):", max_new_tokens=16, proposer=NgramProposer(), k="auto").stats
    assert second["verify_curve_seconds"] == 0 and "verify cost" not in capsys.readouterr().err


@pytest.mark.parametrize("method", ["plain", "draft-model"])
def test_streamed_pieces_add_up_to_the_text(target, method):
    """on_text's pieces arrive as tokens are committed (many pieces, none taken back) and add up to
    the text, through token healing and a stop string."""
    proposer = None if method == "plain" else DraftModelProposer(model=target.model)
    settings = {"max_new_tokens": 40, "temperature": 0.8, "seed": 3, "proposer": proposer}
    whole = generate(target, "def f(x):\n    ", **settings).texts[0]
    stop = re.search(r"[a-zA-Z]{2}", whole[len(whole) // 2:]).group()      # a stop string that occurs
    pieces: list[str] = []
    result = generate(target, "def f(x):\n    ", stop=(stop,), on_text=lambda i, piece: pieces.append(piece),
                      **settings)
    assert len(pieces) > 3 and "".join(pieces) == result.texts[0] == whole[:whole.index(stop)]
