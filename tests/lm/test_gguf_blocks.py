"""A GGUF file's Q8_0/Q4_0/Q4_1 matrices run as stored (the default; `--quantize gguf` says so,
lm/gguf_blocks.py): files written here as llama.cpp writes them (tests/gguf_helpers.py) load with
each Linear holding the file's blocks, and compute the logits of transformers' model whose every matrix is the PyTorch
reference of those blocks (kernels/blocks.py) on weights quantized here in transformers' own row
order; Phi-3 (fused projections) and Qwen3 files run every matrix as stored; speculative greedy
equals plain greedy; a matrix of another type is named and runs; a model run as stored holds its blocks
and nothing beside them (within 1.3x of the file's tensor bytes), and none of the file's pages once loaded."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from specdec.api import load
from specdec.cli import main
from specdec.decoding.engine import plain_generate, speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.kernels import blocks
from specdec.lm import gguf
from specdec.lm.gguf_blocks import FORMATS, gguf_matrices, load_as_stored
from specdec.lm.model import Linear
from specdec.proposers import NgramProposer, SelfDraftProposer

from ..gguf_helpers import Q, byte_level_tokenizer, hf_model, write_gguf

# cycled over the matrices as written (the embedding, then q, k, v, o, gate, up, down of each layer):
# the embedding and down in Q8_0, q/k/v in Q4_1, o in Q8_0, gate/up in Q4_1
TYPES = (Q.Q8_0, Q.Q4_1, Q.Q4_1, Q.Q4_1, Q.Q8_0, Q.Q4_1, Q.Q4_1)


@pytest.fixture(scope="module")
def written(tmp_path_factory, gguf_cache):
    """(the transformers model written, its .gguf file in Q8_0 and Q4_1): a Llama with tied embeddings."""
    model = hf_model("llama", tie_word_embeddings=True)
    return model, write_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", model, byte_level_tokenizer(), "llama",
                             types=TYPES)


class BlocksLinear(torch.nn.Module):
    """The PyTorch reference of a quantized matrix (blocks.linear), in place of an nn.Linear."""

    def __init__(self, weight: torch.Tensor, qtype):
        super().__init__()
        raw = quantize(np.ascontiguousarray(weight.detach().float().numpy()), qtype)
        self.blocks = blocks.from_gguf(raw, FORMATS[qtype.name], tuple(weight.shape))
        self.dense = torch.from_numpy(dequantize(raw, qtype))

    def forward(self, x):
        return blocks.linear(x, self.blocks)


@torch.no_grad()
def blocks_reference(model, path):
    """transformers' model of `path` with every matrix quantized here, in its own row order, to the
    type the file stores it in, computed by blocks.linear; the embedding the unembedding's values."""
    types = {raw.name: Q[raw.type] for raw in gguf.raw_tensors(path)}
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear):
            parent, _, child = name.rpartition(".")
            qtype = types["model.embed_tokens.weight" if name == "lm_head" else name + ".weight"]
            setattr(model.get_submodule(parent) if parent else model, child, BlocksLinear(m.weight, qtype))
    model.model.embed_tokens.weight.copy_(model.lm_head.dense)
    return model


@torch.no_grad()
def test_each_matrix_holds_the_files_blocks_and_computes_the_reference_logits(written):
    model, path = written
    target = load(path, quantize="gguf")
    formats = {name: m.stored.format for name, m in target.model.named_modules() if isinstance(m, Linear)}
    assert set(formats.values()) == {"q8_0", "q4_1"} and target.model.stack is not None  # all in the kernels
    reference = blocks_reference(model, path)
    layer, theirs = target.model.model.layers[0], reference.model.layers[0]
    qkv = torch.cat([theirs.self_attn.q_proj.dense, theirs.self_attn.k_proj.dense, theirs.self_attn.v_proj.dense])
    assert torch.equal(layer.self_attn.qkv_proj.stored.dense(), qkv)  # fused, q and k rows as transformers'
    assert torch.equal(target.model.lm_head.dense(), reference.lm_head.dense)
    ids = torch.randint(3, 300, (4, 8), generator=torch.Generator().manual_seed(1))
    ours = target.model(ids).logits
    error = (ours - reference(ids).logits).abs().amax(-1)  # (4, 8) per position
    # transformers' fp32 attention differs from specdec's in the last bits, which now and then moves an
    # activation across an int8 rounding boundary (then ~0.05 on that position and the later ones of its row)
    assert (error <= 1e-5).float().mean() >= 0.75 and error.max() <= 0.25, error
    assert torch.equal(load(path).model(ids).logits, ours)  # the default: as stored
    converted = load(path, quantize="bf16").model  # the bf16 conversion, asked for: another model
    assert (ours - converted(ids).logits).abs().max() > 1e-2


def test_speculative_greedy_equals_plain_greedy_as_stored(written):
    _, path = written
    target = load(path, quantize="gguf").model
    prompts, rule, greedy = [[5, 9, 2, 5, 9], list(range(20, 37))], StopRule(max_new_tokens=24), SamplingConfig()
    plain, _ = plain_generate(target, prompts, rule, greedy)
    for proposer, k in [(SelfDraftProposer(target=target), 3), (NgramProposer(), 2)]:
        rows, metrics = speculative_generate(target, proposer, prompts, rule, greedy, k)
        assert [r.tokens for r in rows] == [r.tokens for r in plain] and metrics.proposed > 0


@pytest.mark.parametrize("family, changes", [
    ("phi3", {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}),  # q/k/v and gate/up stored fused
    ("qwen3", {"head_dim": 32})])
@torch.no_grad()
def test_other_families_run_every_matrix_as_stored_near_their_bf16_conversion(family, changes, tmp_path, gguf_cache):
    path = write_gguf(tmp_path / f"{family}.gguf", hf_model(family, tie_word_embeddings=False, **changes),
                      byte_level_tokenizer(), family, types=(Q.Q8_0,))
    target = load(path, quantize="gguf").model
    assert {m.stored.format for m in target.modules() if isinstance(m, Linear)} == {"q8_0"} and target.stack
    embedding = next(raw for raw in gguf.raw_tensors(path) if raw.name == "model.embed_tokens.weight")
    assert torch.equal(target.model.embed_tokens.dense(), torch.from_numpy(dequantize(embedding.data, Q.Q8_0)))
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    assert (target(ids).logits - load(path, quantize="bf16").model(ids).logits).abs().max() < 0.25  # 8-bit apart


def test_a_matrix_of_another_type_is_named_and_keeps_the_bf16_values(tmp_path, gguf_cache):
    path = write_gguf(tmp_path / "mixed.gguf", hf_model("qwen2", tie_word_embeddings=False),
                      byte_level_tokenizer(), "qwen2", types=(Q.Q4_0, Q.MXFP4, Q.Q8_0))
    given, others = gguf_matrices({raw.name: raw for raw in gguf.raw_tensors(path)})
    assert set(others.values()) <= {"MXFP4", "MXFP4+Q4_0", "MXFP4+Q8_0", "MXFP4+Q4_0+Q8_0"} and others and given
    with pytest.warns(UserWarning, match=r"mixed\.gguf: \d+ matrices run from the converted checkpoint's bf16 values"
                                         r".*stored as MXFP4"):
        target = load(path, quantize="gguf")
    held = {name: m.stored.format for name, m in target.model.named_modules() if isinstance(m, Linear)}
    assert {held[name] for name in others} == {"bf16"} and {held[name] for name in given} <= {"q4_0", "q8_0"}
    rows, _ = plain_generate(target.model, [[5, 6, 7]], StopRule(max_new_tokens=4), SamplingConfig())
    assert len(rows[0].tokens) == 4


def test_a_checkpoint_folder_is_refused_by_name(written):
    _, path = written
    for asked in ("gguf", "bf16"):
        with pytest.raises(SpecdecError, match=rf"--quantize {asked} is for a \.gguf file.*checkpoint folder"):
            load(gguf.folder(path), quantize=asked)


def test_generate_names_the_formats(written, capsys):
    _, path = written
    args = ["generate", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "8", "--temperature", "0",
            "--json"]
    assert main([*args, "--quantize", "gguf"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["weights"] in ("q8_0 + q4_1", "q4_1 + q8_0") and "stored" in stats["backend"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["weights"] == stats["weights"]  # the default: as stored
    assert main([*args, "--quantize", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["weights"] == "bf16"  # the bf16 conversion, asked for


def held_bytes(model) -> int:
    """The bytes of every tensor a model holds, each once: parameters, buffers and the kernels' matrices
    (a module's `stored`, the packed data its runs share) and anything unpacked from them."""
    held = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    for m in model.modules():
        stored = getattr(m, "stored", None)
        if stored is not None:
            held[stored.data.data_ptr()] = stored.nbytes
            for b in getattr(stored, "_reference", None) or []:
                held.update({t.data_ptr(): t.numel() * t.element_size() for t in b[1:] if t is not None})
    return sum(held.values())


# Q4_K_M's types: most matrices in Q4_K, v and down (and so the fused qkv's last run) in Q6_K
MEDIUM = (Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q6_K)


@pytest.mark.parametrize("tied", [False, True])
@torch.no_grad()
def test_a_model_run_as_stored_holds_about_its_files_bytes(tied, tmp_path, gguf_cache):
    """Each matrix as its packed blocks and nothing beside them, the embedding's rows dequantized from
    blocks at lookup (the file's own, or the tied unembedding's): within 1.3x of the file's tensors."""
    model = hf_model("qwen2", tie_word_embeddings=tied, hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / "medium.gguf", model, byte_level_tokenizer(), "qwen2", types=MEDIUM)
    target = load(path, quantize="gguf").model
    file_bytes = sum(t.n_bytes for t in gguf.open_file(path).tensors)
    assert held_bytes(target) <= 1.3 * file_bytes, (held_bytes(target), file_bytes)
    assert not any(t.is_meta for t in [*target.parameters(), *target.buffers()])
    raws = {raw.name: raw for raw in gguf.raw_tensors(path)}
    table = raws["model.embed_tokens.weight"]
    ids = torch.tensor([[319, 0, 17], [5, 5, 300]])
    values = torch.from_numpy(dequantize(table.data, Q[table.type])).reshape(table.shape)
    assert torch.equal(target.model.embed(ids), values[ids])  # the file's values, exactly
    assert target.num_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(IndexError, match="outside a matrix of 320 rows"):
        target.model.embed(torch.tensor([[320]]))
    with pytest.raises(SpecdecError, match="as quantized blocks only.*not saved as a checkpoint"):
        target.hf_state_dict()
    draft = SelfDraftProposer(target=target)  # requantized from the blocks' values; the embedding shared
    shared = draft.model.lm_head.stored if tied else target.model.embed_tokens.stored
    assert draft.model.model.embed_tokens.stored is shared and draft.model.held_as_blocks()
    prompts, rule, greedy = [[5, 9, 2, 5, 9]], StopRule(max_new_tokens=12), SamplingConfig()
    rows, metrics = speculative_generate(target, draft, prompts, rule, greedy, 3)
    assert rows[0].tokens == plain_generate(target, prompts, rule, greedy)[0][0].tokens and metrics.proposed > 0


def resident_bytes_of(path) -> int:
    """This process's resident bytes of its mappings of the file at `path` (Linux: /proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                ours = line.rstrip("\n").endswith(str(path))
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_loaded_model_holds_none_of_the_files_pages_and_no_view_of_them(tmp_path, gguf_cache):
    """The model holds copies in its own layout, so the file's pages need not stay beside them (RssFile):
    after the load this process holds none of them, although the file is still open, and no tensor of
    the model lies in the mapping. Releasing pages never touches memory that is not the map's."""
    model = hf_model("qwen2", tie_word_embeddings=False, hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / "medium.gguf", model, byte_level_tokenizer(), "qwen2", types=MEDIUM).resolve()
    reader = gguf.open_file(path)
    tensor_bytes = sum(t.n_bytes for t in reader.tensors)
    assert sum(int(np.asarray(t.data).view(np.uint8).sum() >= 0) for t in reader.tensors)  # every page read once
    assert resident_bytes_of(path) >= tensor_bytes  # what the measure sees
    copy = np.array(reader.tensors[-1].data)
    reader.release(copy)  # a copy is left alone (MADV_DONTNEED would zero anonymous pages)
    assert np.array_equal(copy, reader.tensors[-1].data)
    target = load_as_stored(path, reader=reader)
    assert resident_bytes_of(path) == 0
    start = np.frombuffer(reader.map, np.uint8).ctypes.data
    held = [*target.parameters(), *target.buffers()] + [
        t for m in target.modules() if getattr(m, "stored", None) is not None
        for t in [m.stored.data, *(run.data for run in m.stored.runs or [])]]
    assert held and not [t for t in held if start <= t.data_ptr() < start + len(reader.map)]
    ids = torch.tensor([[5, 9, 2]])
    assert torch.equal(target(ids).logits, load(path, quantize="gguf").model(ids).logits)  # pages read again as before


# ---- a GGUF draft model: its draft vocabulary counted from local text ----

COUNTED = {"code": ["def add(a, b):\n    return a + b\n\n" * 4,
                    "import os\nfor path in os.listdir('.'):\n    print(path)\n"]}


@pytest.fixture(scope="module")
def draft_file(tmp_path_factory, gguf_cache):
    """Another model (another seed) of `written`'s tokenizer, as a .gguf in the same types: a draft."""
    model = hf_model("llama", seed=1, tie_word_embeddings=True)
    return write_gguf(tmp_path_factory.mktemp("draft") / "draft.gguf", model, byte_level_tokenizer(), "llama",
                      types=TYPES)


@torch.no_grad()
def test_a_gguf_draft_drafts_over_a_vocabulary_counted_here_exactly(written, draft_file, monkeypatch):
    """A GGUF draft saved without token counts: asked for a draft vocabulary, it counts the tokens of
    local text once (lm/local_counts) and saves the counts in its cache entry (keyed by its hash; no
    conversion written); the vocabulary's
    unembedding keeps the file's format, each logit the full unembedding's very number; greedy and
    seeded T=1 speculative decoding give plain decoding's tokens, with and without stopping unsure."""
    from specdec.lm import local_counts
    from specdec.proposers.drafters import DraftModelOptions, build_drafter

    monkeypatch.setattr(local_counts, "corpus", lambda: COUNTED)
    target = load(written[1], quantize="gguf")
    as_stored = dict(draft_quantize=None)  # the file's own formats (else Q4_0 where they read more)
    proposer = build_drafter("draft-model", target, str(draft_file), DraftModelOptions(draft_vocab=40, **as_stored))
    saved = gguf.entry(draft_file) / f"local_token_counts-v{local_counts.VERSION}.safetensors"
    assert saved.is_file() and [p.name for p in saved.parent.iterdir()] == [saved.name]
    ids = proposer.draft_ids
    specials = [i for i in target.tokenizer.tok.get_added_tokens_decoder()]
    assert len(ids) == 40 and set(specials) <= set(ids.tolist())  # the end of a turn is always draftable
    head, rows = proposer.model.lm_head.stored, proposer.vocab.unembedding.stored
    assert rows.format == head.format == "q8_0" and rows.shape == (40, head.shape[1])
    hidden = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(0))
    assert torch.equal(proposer.vocab.unembedding(hidden), proposer.model.lm_head(hidden)[:, ids])

    def failing():
        raise AssertionError("the saved counts are read, not counted again")
    monkeypatch.setattr(local_counts, "corpus", failing)
    unsure = build_drafter("draft-model", target, str(draft_file),
                           DraftModelOptions(draft_vocab=40, stop_below=0.9, **as_stored))
    assert torch.equal(unsure.draft_ids, ids)
    from specdec.proposers.draft_model import chosen_vocab
    by_default = build_drafter("draft-model", target, str(draft_file), DraftModelOptions(**as_stored))
    counts = local_counts.counted_once(gguf.entry(draft_file), target.tokenizer.tok, by_default.vocab_size)
    size = chosen_vocab(by_default.model, target.model, counts)  # a GGUF draft's default: the cost model's size
    assert size is not None and len(by_default.draft_ids) == size
    full = build_drafter("draft-model", target, str(draft_file), DraftModelOptions(draft_vocab="full", **as_stored))
    assert full.draft_ids is None
    prompts, rule = [[5, 9, 2, 5, 9], list(range(20, 37))], StopRule(max_new_tokens=24)
    for sampling in (SamplingConfig(), SamplingConfig(1.0, seed=3)):
        plain, _ = plain_generate(target.model, prompts, rule, sampling)
        proposed = {}
        for drafter in (proposer, unsure):
            for k in (3, "auto"):
                rows_, metrics = speculative_generate(target.model, drafter, prompts, rule, sampling, k)
                assert [r.tokens for r in rows_] == [r.tokens for r in plain], (sampling, k)
                proposed[drafter, k] = metrics.proposed / metrics.row_steps
        assert proposed[unsure, 3] < proposed[proposer, 3]  # a random draft is unsure: it stops early


def test_the_cost_model_keeps_the_ids_the_counts_hold(written, draft_file):
    """chosen_vocab: counts on a few ids (a draft vocabulary of them loses nothing) give a small
    vocabulary; counts spread evenly (each id cut costs acceptance in proportion) the full one."""
    from specdec.proposers.draft_model import chosen_vocab
    from specdec.proposers.drafters import DraftModel

    target = load(written[1], quantize="gguf")
    draft = DraftModel().network(target, draft_file).model
    V = draft.config.vocab_size
    few = torch.zeros(V, dtype=torch.int64)
    few[:10] = 100
    assert chosen_vocab(draft, target.model, few) == 10  # V/32: the smallest size weighed that holds them all
    assert chosen_vocab(draft, target.model, torch.ones(V, dtype=torch.int64)) is None


def test_a_draft_requantized_at_load_holds_the_files_values_rounded_again(written):
    """raw_tensors(requantize): each matrix of a type named comes as gguf's own quantization of the
    values the file stores, in the type asked for; the others, and the vectors, as stored. A model so
    loaded runs the new type's blocks, in fewer bytes than Q8_0's."""
    _, path = written
    stored = {raw.name: raw for raw in gguf.raw_tensors(path)}
    again = {raw.name: raw for raw in gguf.raw_tensors(path, {"Q8_0": "Q4_0"})}
    assert {raw.type for raw in stored.values()} >= {"Q8_0", "Q4_1", "F32"}
    for name, raw in stored.items():
        if raw.type == "Q8_0":
            values = dequantize(raw.data, Q.Q8_0).reshape(raw.shape)
            assert again[name].type == "Q4_0" and again[name].shape == raw.shape
            assert np.array_equal(again[name].data, quantize(values, Q.Q4_0))
        else:
            assert again[name].type == raw.type and np.array_equal(again[name].data, raw.data)
    from specdec.lm.gguf_blocks import load_as_stored
    from specdec.proposers.draft_model import stored_bytes

    as_stored, smaller = load_as_stored(path), load_as_stored(path, requantize={"Q8_0": "Q4_0"})
    formats = {m.stored.format for m in smaller.modules() if isinstance(m, Linear)}
    assert formats == {"q4_0", "q4_1"} and stored_bytes(smaller) < stored_bytes(as_stored)


@pytest.mark.parametrize("requantize, says", [({"Q8_0": "Q4_K"}, "cannot quantize into Q4_K"),
                                              ({"Q8": "Q4_1"}, "'Q8' is not a GGML tensor type")])
def test_a_requantization_gguf_cannot_make_is_refused_by_name(written, requantize, says):
    with pytest.raises(SpecdecError, match=says):
        list(gguf.raw_tensors(written[1], requantize))
