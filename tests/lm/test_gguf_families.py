"""Each family people download as GGUF (Llama 3.x with its llama3 rotary scaling, Mistral, Qwen2/2.5,
Qwen3, Phi-3, Gemma 3), a tiny random file written here as llama.cpp writes it (tests/gguf_helpers.py),
in float formats (F32, F16, BF16) and in blocks (Q8_0, Q5_0 and Q4_0 by the `gguf` package's own
quantizer; Q4_K and Q6_K, which it cannot make, built by the helpers), runs as stored by default
(every matrix in the file's own format) and computes what transformers computes on the file as its
own GGUF loading reads it (load_gguf_checkpoint: its config, the `gguf` package's dequantized
tensors, float32). Float files: logits within LOGITS_TOL of that model, greedy tokens equal. Files in
blocks: the kernels multiply blocks by activation rows rounded to int8 per block of 32 (as llama.cpp
rounds them to Q8), so the reference is that model with each quantized matrix computed by the
kernels' PyTorch reference (kernels.blocks.linear) over the same blocks (made by the helpers from the
model written, their values checked equal to transformers' reading); an activation landing on the
other side of an int8 rounding boundary in the two float orders of summation moves that position
and the later ones of its row by about a tenth, so the median position is within LOGITS_TOL and all
within ROUNDING_TOL (a model computing otherwise is off by units everywhere); each greedy token is
the reference's choice on the same prefix, or within ROUNDING_TOL of it. Where transformers' reading
of the metadata drops what llama.cpp reads (Llama 3.1's rotary factors, Qwen3's head_dim, Gemma 3's
final soft cap), the reference's config is given it, and the test says so. Gemma 3 is also checked
beyond its window under speculation, on each instruction set the kernels run."""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from specdec.api import load, weights_format
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.kernels import blocks
from specdec.lm import gguf
from specdec.lm.gguf_blocks import FORMATS

from ..gguf_helpers import Q, byte_level_tokenizer, gguf_names, hf_model, quantize_any, write_gguf
from .test_quant import RUNS, assert_speculation_equals_plain_on_each_isa

LOGITS_TOL = 1e-4
ROUNDING_TOL = 0.25  # a position where an activation's int8 rounding went the other way (see the docstring)
# rows of 256 values: the K-quants' super-blocks; small enough to run in milliseconds
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# name -> (transformers family, GGUF architecture, config changes, the reference's config beyond transformers'
# reading of the metadata: what that reading drops and llama.cpp reads)
FAMILIES = {
    "llama3": ("llama", "llama", {"rope_parameters": LLAMA3, "tie_word_embeddings": True},
               {"rope_parameters": LLAMA3}),
    "mistral": ("mistral", "llama", {"sliding_window": None, "tie_word_embeddings": False}, {}),
    "qwen2": ("qwen2", "qwen2", {"tie_word_embeddings": False}, {}),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 64, "tie_word_embeddings": False}, {"head_dim": 64}),
    "phi3": ("phi3", "phi3", {"tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
             {}),
    # 6 layers: five local ones (a window of 8 positions, rotary base 10000) and a global one (base 1e6)
    "gemma3": ("gemma3", "gemma3", {"num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "head_dim": 256, "sliding_window": 8, "max_position_embeddings": 256}, {}),
    "gemma3-softcap": ("gemma3", "gemma3", {"num_hidden_layers": 6, "num_attention_heads": 2,
                                            "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 8,
                                            "final_logit_softcapping": 3.0}, {"final_logit_softcapping": 3.0}),
}
TYPES = {"floats": (Q.F32, Q.F16, Q.BF16), "blocks": (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_0)}


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def extra_metadata(name: str, model):
    """What llama.cpp's converter writes beyond the helpers' keys: Llama 3.1's rotary scaling as
    per-frequency factors, Gemma 3's final soft cap."""
    def write(w):
        if name == "llama3":
            head_dim = model.config.hidden_size // model.config.num_attention_heads
            plain = 1.0 / (LLAMA3["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
            w.add_tensor("rope_freqs.weight", (plain / model.model.rotary_emb.inv_freq).numpy())
        if model.config.model_type == "gemma3_text" and model.config.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(model.config.final_logit_softcapping)
    return write


@pytest.fixture(scope="module", params=[(name, types) for name in FAMILIES for types in TYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def written(request, tmp_path_factory, gguf_cache, tok):
    """(name, the .gguf file, transformers' model of it) for each family and kind of format."""
    name, types = request.param
    family, arch, changes, given = FAMILIES[name]
    model = hf_model(family, **{**SIZES, **changes})
    path = write_gguf(tmp_path_factory.mktemp(name) / f"{name}-{types}.gguf", model, tok, arch, types=TYPES[types],
                      extra=extra_metadata(name, model), model_name=f"tiny {family}")
    return name, path, blocks_reference(transformers_reading(path, given), model, path, arch)


def transformers_reading(path, given: dict) -> transformers.PreTrainedModel:
    """A transformers model of the file as its own GGUF loading reads it (the config, then the `gguf`
    package's dequantized tensors in float32), its config given `given` beyond that reading."""
    keys = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    keys.setdefault("pad_token_id", None)  # Phi3Config's default, 32000, lies outside a small vocabulary
    config = transformers.AutoConfig.for_model(keys.pop("model_type"), **{**keys, **given})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


class BlocksLinear(torch.nn.Module):
    """The kernels' arithmetic over a quantized matrix (blocks.linear), in place of an nn.Linear."""

    def __init__(self, stored: blocks.Blocks, bias: torch.Tensor | None):
        super().__init__()
        self.stored, self.bias = stored, bias

    def forward(self, x):
        return blocks.linear(x, self.stored, self.bias)


@torch.no_grad()
def blocks_reference(reference, written, path, arch: str):
    """`reference` with each matrix the file stores in blocks computed by blocks.linear over those
    blocks, made here from the model `written` in transformers' row order (the helpers' quantizers
    work row by row, so this is the file's blocks with llama.cpp's row order undone), their values
    checked equal to the reference's (transformers' reading of the file)."""
    types = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    state = written.state_dict()
    names = gguf_names(state, arch)
    for name, m in list(reference.named_modules()):
        if not isinstance(m, torch.nn.Linear):
            continue
        weight = "model.embed_tokens.weight" if name == "lm_head" and "output.weight" not in types else name + ".weight"
        qtype = types[names[weight]]
        if qtype in (Q.F32, Q.F16, Q.BF16):
            continue
        values = state[weight].float().numpy()
        raw = quantize_any(values, qtype)
        assert torch.equal(torch.from_numpy(dequantize(raw, qtype)).reshape(values.shape), m.weight), name
        parent, _, child = name.rpartition(".")
        setattr(reference.get_submodule(parent) if parent else reference, child,
                BlocksLinear(blocks.from_gguf(raw, FORMATS[qtype.name], values.shape), m.bias))
    return reference


@torch.no_grad()
def test_each_family_runs_as_stored_and_computes_what_transformers_reads_from_the_file(written):
    name, path, reference = written
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        target = load(path)
    assert not [w for w in seen if "not as stored" in str(w.message)]
    formats = weights_format(target)
    assert "bf16" not in formats.split(" + ") or path.stem.endswith("floats"), formats  # only a BF16 file's
    floats = path.stem.endswith("floats")
    ids = torch.randint(3, 300, (1, 24) if floats else (4, 8), generator=torch.Generator().manual_seed(1))
    error = (target.model(ids).logits - reference(ids).logits).abs().amax(-1)  # per position
    if floats:
        assert error.max() <= LOGITS_TOL, error
    else:
        assert error.median() <= LOGITS_TOL and error.max() <= ROUNDING_TOL, error
    ids = ids[:1]
    got = reference_generate(target.model, ids[0].tolist(), StopRule(12), SamplingConfig()).tokens
    if floats:
        reference.generation_config.eos_token_id = None
        assert got == reference.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 24:].tolist()
    else:  # each token the reference's greedy choice on the same prefix, or within a rounding of it
        logits = reference(torch.tensor([ids[0].tolist() + got])).logits[0, ids.shape[1] - 1:-1]  # (12, V)
        shortfall = logits.amax(-1) - logits[torch.arange(12), got]
        assert (shortfall <= ROUNDING_TOL).all() and (shortfall == 0).float().mean() >= 0.75, shortfall


@pytest.mark.parametrize("name", ["gemma3", "gemma3-softcap"])
def test_gemma3_is_read_as_llama_cpp_reads_it(name, tmp_path, gguf_cache, tok):
    """Local layers every layer but each sixth, their rotary base 10000, the global one the file's;
    the final soft cap where the file sets it; norms held as transformers holds them (the file's minus 1)."""
    family, arch, changes, given = FAMILIES[name]
    model = hf_model(family, **{**SIZES, **changes})
    path = write_gguf(tmp_path / "gemma3.gguf", model, tok, arch, types=(Q.F32,), extra=extra_metadata(name, model))
    reference = transformers_reading(path, given)
    arch = load(path).model.config
    assert arch.family == "gemma3_text" and arch.local_layers == (0, 1, 2, 3, 4) and arch.sliding_window == 8
    assert arch.local_rope_theta == 10000.0 and arch.rope_theta == reference.config.rope_parameters[
        "full_attention"]["rope_theta"] and arch.max_position_embeddings == reference.config.max_position_embeddings
    assert arch.final_logit_softcapping == reference.config.final_logit_softcapping
    norms = {raw.name: raw for raw in gguf.raw_tensors(path) if raw.name.endswith("norm.weight")}
    state = reference.state_dict()
    assert len(norms) == 6 * 4 + 6 * 2 + 1 and all(torch.equal(torch.as_tensor(raw.data), state[name])
                                                   for name, raw in norms.items())


@pytest.mark.skipif(not RUNS, reason="the CPU kernels do not run here")
def test_gemma3_speculation_equals_plain_decoding_beyond_its_window(tmp_path, gguf_cache, tok):
    """Prompts and outputs longer than the window of 8: the local layers' mask with a cache, draft
    tokens verified and rolled back, on each instruction set the kernels run."""
    model = hf_model("gemma3", **{**SIZES, **FAMILIES["gemma3"][2]})
    target = load(write_gguf(tmp_path / "gemma3.gguf", model, tok, "gemma3", types=TYPES["blocks"]))
    assert_speculation_equals_plain_on_each_isa(target.model)


def test_a_gemma3_file_without_a_window_has_only_global_layers(tmp_path, gguf_cache, tok):
    """llama.cpp runs a Gemma 3 file that gives no sliding window with every layer global."""
    model = hf_model("gemma3", **{**SIZES, **FAMILIES["gemma3"][2], "sliding_window": None})
    arch = load(write_gguf(tmp_path / "global.gguf", model, tok, "gemma3", types=(Q.F32,))).model.config
    assert arch.local_layers == () and arch.max_position_embeddings == 256


def test_families_specdec_cannot_run_from_a_gguf_are_refused_by_name(tmp_path, tok):
    model = hf_model("llama", **SIZES)
    path = write_gguf(tmp_path / "gemma2.gguf", model, tok, "gemma2", types=(Q.F32,))
    with pytest.raises(SpecdecError, match="GGUF architecture 'gemma2' is not supported.*gemma3"):
        load(path)


@torch.no_grad()
def test_gemma3_tokens_compute_the_same_alone_and_in_a_window(tmp_path, gguf_cache, tok):
    """Gemma 3's layers run on PyTorch operators, its matrices on int8-rounded activations: a token's
    logits are bit-identical whether it is computed alone after the prompt or within a window of 4
    (what speculation's verification relies on), across the window's edge (prompt 16 > window 8)."""
    model = hf_model("gemma3", **{**SIZES, **FAMILIES["gemma3"][2]})
    target = load(write_gguf(tmp_path / "gemma3.gguf", model, tok, "gemma3", types=TYPES["blocks"])).model
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    alone, window = target.new_cache(2), target.new_cache(2)
    target(ids[:, :16], cache=alone)
    target(ids[:, :16], cache=window)
    one_by_one = torch.cat([target(ids[:, i:i + 1], cache=alone).logits for i in range(16, 20)], dim=1)
    assert torch.equal(one_by_one, target(ids[:, 16:], cache=window).logits)
