"""GGUF files (llama.cpp's one-file checkpoints), mapped and never copied (gguf_file.py): their metadata
read into specdec's terms as llama.cpp reads it (`config_of`: the architecture, Llama 3.1's rope_freqs,
Phi-3's fused matrices, Gemma 3's local layers; `tokenizer`: built in memory by transformers' GGUF
converter, with llama.cpp's BOS rule and end-of-generation set, `end_ids`), the weights under their
transformers names as stored (`raw_tensors`, which lm/gguf_blocks.py runs) or rounded again on request
(`requantized`), and a conversion where something asks for one (`converted` in memory; `checkpoint`: a
folder in a bounded cache keyed by the file's sha256, written atomically under a lock; docs/checkpoints.md).
A broken file or what specdec cannot run: one SpecdecError line. It knows nothing of decoding or serving.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecdecError
from .atomic import atomic_dir, exclusive, recover, write_error
from .checkpoint import CONFIG, META, WEIGHTS, sha256
from .gguf_file import GGUFFile
from .tokenizer import Tokenizer

SUFFIX = ".gguf"
FORMAT = 2  # of the converted folders: a conversion that changes bumps it, so older folders are not reused
KEEP = 3  # files whose conversions the cache keeps, the most recently used (a target, its draft, a teacher)
INDEX, INDEX_SIZE = "index.json", 64  # in the cache: each file's conversion's weights' sha256, the 64 latest
# general.architecture -> (model_type, transformers class); llama.cpp writes Mistral as "llama"
FAMILIES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
            "qwen3": ("qwen3", "Qwen3ForCausalLM"), "phi3": ("phi3", "Phi3ForCausalLM"),
            "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
# ARCH.* metadata read into config.json
CONFIG_KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
               "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
               "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
               "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
               "vocab_size": "vocab_size", "attention.key_length": "head_dim",
               "rope.scaling.original_context_length": "original_max_position_embeddings"}
FAMILY_KEYS = {"phi3": {"attention.sliding_window": "sliding_window"},  # read for that family only
               "gemma3_text": {"attention.sliding_window": "sliding_window",
                               "final_logit_softcapping": "final_logit_softcapping"}}
# Gemma 3's keys read by gemma3_config (llama.cpp's defaults where absent: 6, 10000)
GEMMA3_KEYS = {"attention.sliding_window_pattern", "rope.freq_base_swa"}
# ARCH.* metadata checked against what the keys above imply, or that never changes the arithmetic
CHECKED_KEYS = {"rope.dimension_count", "attention.value_length", "rope.scaling.type", "rope.scaling.factor",
                "rope.scaling.finetuned"}
# ARCH.* metadata that says nothing when 0 (older llama.cpp writes expert counts of 0 for dense models)
ZERO_KEYS = {"expert_count", "expert_used_count"}
# GGUF tensor names -> transformers' (llama.cpp's standard names for dense decoders)
TENSOR_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_(q|k)_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)", r"model.layers.\1.mlp.\2_proj.\3"),
]
FUSED = [(r"blk\.(\d+)\.attn_qkv\.weight", r"model.layers.\1.self_attn.qkv_proj.weight"),
         (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.gate_up_proj.weight")]
# Gemma 3's norms around attention and MLP (its ffn_norm is the MLP's input norm, as Llama's)
GEMMA3_NORMS = [(r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
                (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.pre_feedforward_layernorm.weight"),
                (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight")]
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's rotary scaling as per-frequency factors: read into the config
# the texts of the tokens llama.cpp ends a generation at, whatever the metadata names (llama-vocab.cpp's
# end-of-generation set, kept by token text until converters write every end id into the metadata)
END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
# the fill-in-the-middle tokens llama.cpp also ends at: the metadata's id, else the first of these texts found
FIM_ENDS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
            "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
            "fim_sep": ("<|file_sep|>",)}


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec" / "from-gguf"


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(SUFFIX)


def open_file(path: str | Path) -> GGUFFile:
    """The file mapped (gguf_file.GGUFFile: metadata read, tensors views of the mapped bytes), or SpecdecError."""
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"no GGUF file at {path}: pass --model with an existing .gguf file or a checkpoint folder")
    try:
        reader = GGUFFile(path)
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError, OverflowError, struct.error) as e:
        raise SpecdecError(f"{path} is not a readable GGUF file (truncated or corrupt: {e}); "
                           "download it again") from None
    return reader


def field(reader, key: str, default=None):
    """A metadata value; a float32 as the shortest decimal that reads back to it (1e-05, as config.json says)."""
    value = reader.fields.get(key)
    if value is None:
        return default
    return float(str(np.float32(value))) if isinstance(value, float) else value


def config_of(reader, where: str) -> dict:
    """The transformers config.json of a GGUF file's metadata (refusing what specdec cannot run)."""
    if (splits := field(reader, "split.count")) not in (None, 1):
        raise SpecdecError(f"{where} is one of {splits} split GGUF files: merge them first "
                           "(llama.cpp's `llama-gguf-split --merge FIRST.gguf OUT.gguf`)")
    arch = field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise SpecdecError(f"{where}: GGUF architecture {arch!r} is not supported; specdec reads GGUF files of "
                           f"{', '.join(FAMILIES)} (other families: load their transformers folder)")
    model_type, cls = FAMILIES[arch]
    keys = {k.removeprefix(arch + "."): k for k in reader.fields if k.startswith(arch + ".")}
    read = CONFIG_KEYS | FAMILY_KEYS.get(model_type, {})
    skipped = CHECKED_KEYS | (GEMMA3_KEYS if model_type == "gemma3_text" else set())
    for short in sorted(set(keys) - set(read) - skipped):
        if short in ZERO_KEYS and field(reader, keys[short]) == 0:
            continue
        raise SpecdecError(f"{where}: GGUF key {keys[short]!r} = {field(reader, keys[short])!r} is refused: "
                           f"specdec's {model_type} does not implement it, and running without it would "
                           "compute a different model")
    cfg = {read[k]: field(reader, keys[k]) for k in keys if k in read}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    cfg.setdefault("vocab_size", len(tokens) if tokens is not None else None)
    cfg.setdefault("rope_theta", 10000.0)
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.setdefault("head_dim", (cfg.get("hidden_size") or 0) // heads)
    rotary = field(reader, keys.get("rope.dimension_count", ""), head_dim)
    if rotary != head_dim and model_type == "phi3":  # Phi-3 rotates the first dims of a head
        cfg["partial_rotary_factor"] = rotary / head_dim
    for key in ("rope.dimension_count", "attention.value_length"):
        value = field(reader, keys.get(key, ""), head_dim)
        if value != head_dim and not (key == "rope.dimension_count" and model_type == "phi3"):
            raise SpecdecError(f"{where}: GGUF key {keys[key]!r} = {value} is refused: specdec's {model_type} "
                               f"runs heads whose keys, values and rotary dims all have head_dim = {head_dim}")
    rope = rope_of(reader, keys, float(cfg.pop("rope_theta")), head_dim, where)
    if model_type == "gemma3_text":
        rope = gemma3_config(reader, keys, cfg, rope)
    names = {t.name for t in reader.tensors}
    return {"architectures": [cls], "model_type": model_type, **cfg, "rope_parameters": rope,
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": end_ids(reader), "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
            "dtype": "bfloat16"}


def rope_of(reader, keys: dict, theta: float, head_dim: int, where: str) -> dict:
    """transformers' rope_parameters of the file: default, linear (ARCH.rope.scaling.*), or Llama 3.1's
    llama3 scaling, which llama.cpp stores as per-frequency factors (the rope_freqs tensor)."""
    rope = {"rope_type": "default", "rope_theta": theta}
    kind = field(reader, keys.get("rope.scaling.type", ""), "none")
    factors = next((t.data for t in reader.tensors if t.name == ROPE_FREQS), None)
    if kind == "linear" and factors is None:
        return {**rope, "rope_type": "linear", "factor": float(field(reader, keys["rope.scaling.factor"]))}
    if kind != "none":
        raise SpecdecError(f"{where}: GGUF key {keys['rope.scaling.type']!r} = {kind!r} is refused: specdec reads "
                           "rotary scaling none, linear or llama3 from a GGUF (load the model's transformers folder "
                           "instead)")
    return rope if factors is None else {**rope, **llama3_scaling(np.asarray(factors, np.float64), theta, head_dim,
                                                                  where)}


def gemma3_config(reader, keys: dict, cfg: dict, rope: dict) -> dict:
    """Gemma 3's settings as llama.cpp reads them (src/models/gemma3.cpp), added to cfg in transformers'
    Gemma3TextConfig keys: local layers only where the file gives a window, every
    attention.sliding_window_pattern-th layer global (6 by default; or the pattern as one flag per layer),
    rotated with base rope.freq_base_swa (10000 by default) and no scaling; the query scaled by head_dim's
    -1/2 power, or for the 62-layer model (27B) by hidden_size / heads'; the GELU of Gemma. Returns the
    rope_parameters of both kinds of layer (the file's rotary settings are the global layers')."""
    layers = int(cfg["num_hidden_layers"])
    pattern = field(reader, keys.get("attention.sliding_window_pattern", ""), 6)
    if isinstance(pattern, list):  # llama.cpp's per-layer flags: true where the layer slides
        types = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    else:
        types = ["sliding_attention" if int(pattern) == 0 or i % int(pattern) < int(pattern) - 1
                 else "full_attention" for i in range(layers)]
    cfg.update(layer_types=types, hidden_activation="gelu_pytorch_tanh",
               query_pre_attn_scalar=cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62
               else cfg["head_dim"])
    local = float(field(reader, keys.get("rope.freq_base_swa", ""), 10_000.0))
    return {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, where: str) -> dict:
    """The llama3 rope parameters whose per-frequency factors llama.cpp stored (convert_hf_to_gguf.py
    computes them from factor, low_freq_factor, high_freq_factor and an original context of 8192:
    Llama 3.1's 1, 4 and 8192 are the ones every Llama 3.x ships), or refused by name."""
    from .arch import Arch

    rope = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    plain = Arch(head_dim=head_dim, rope_theta=theta).inv_freq().double()
    scaled = Arch(head_dim=head_dim, rope_theta=theta, rope_scaling=rope).inv_freq().double()
    if factors.shape != tuple(plain.shape) or not np.allclose((plain / scaled).numpy(), factors, rtol=1e-4):
        raise SpecdecError(f"{where}: GGUF tensor {ROPE_FREQS!r} holds rotary frequency factors that are not Llama "
                           "3.1's llama3 scaling (factor, low/high_freq_factor 1 and 4, original context 8192); "
                           "load the model's transformers folder instead")
    return rope


def end_ids(reader) -> int | list[int] | None:
    """The ids that end a generation, as llama.cpp derives its end-of-generation set (llama-vocab.cpp):
    the metadata's eos, eot and eom ids first, then, ascending, every token whose text is an end
    marker (END_TEXTS) and the FIM pad, repo and file-separator tokens (the metadata's ids, else found
    by text: FIM_ENDS). As llama.cpp, <|end|> is left out where <|return|> and <|call|> (or <|calls|>
    and <|flush|>) end a turn instead, and </s> beside <|tool_response>; an id outside the
    vocabulary names no token."""
    tokens = [str(t) for t in field(reader, "tokenizer.ggml.tokens", [])]
    first = {text: i for i, text in reversed(list(enumerate(tokens)))}

    def named(kind: str, texts: tuple[str, ...] = ()) -> int | None:
        i = field(reader, f"tokenizer.ggml.{kind}_token_id")
        if i is not None and 0 <= i < len(tokens):
            return i
        return next((first[t] for t in texts if t in first), None)
    fim = {named(kind, texts) for kind, texts in FIM_ENDS.items()} - {None}
    marked = {first[t] for t in END_TEXTS if t in first}
    ends = [i for i in dict.fromkeys([*map(named, ("eos", "eot", "eom")), *sorted(fim | marked)]) if i is not None]
    texts = {tokens[i] for i in ends}
    if {"<|return|>", "<|call|>"} <= texts or (texts & {"<|call|>", "<|calls|>"} and "<|flush|>" in texts):
        ends = [i for i in ends if tokens[i] != "<|end|>"]
    if "<|tool_response>" in texts:
        ends = [i for i in ends if tokens[i] != "</s>"]
    return ends[0] if len(ends) == 1 else ends or None


def hf_name(gguf_name: str, family: str) -> str | None:
    """transformers' name of a GGUF tensor of the family (Phi-3 stores q/k/v and gate/up fused, as
    transformers' Phi3 does)."""
    for pattern, replacement in (FUSED if family == "phi3" else GEMMA3_NORMS if family == "gemma3_text" else []) \
            + TENSOR_NAMES:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, replacement, gguf_name)
    return None


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a Llama q or k projection's rows (per head: the even rotary
    rows, then the odd ones, back to the two halves transformers rotates), as transformers does.
    Rows only: it applies to quantized blocks as stored."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


@dataclass(frozen=True)
class RawTensor:
    """One weight as the file stores it, under its transformers name."""
    name: str                 # transformers' name, e.g. model.layers.0.self_attn.q_proj.weight
    gguf_name: str            # the file's, e.g. blk.0.attn_q.weight
    type: str                 # the GGML type's name: F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...
    shape: tuple[int, ...]    # the logical shape as transformers holds it: (out, in) for a matrix
    data: np.ndarray          # (rows, bytes per row) uint8 blocks for a quantized type; else the values


def raw_tensors(path: str | Path, requantize: dict[str, str] | None = None, reader=None) -> Iterator[RawTensor]:
    """Each weight of the GGUF file at `path` as stored (quantized blocks as they are, rows of
    Llama's q and k in transformers' order), without dequantizing; a file specdec cannot run, or a
    tensor with no place in its architecture, is refused by name. requantize {GGML type: GGML type}
    (e.g. {"Q5_0": "Q4_1"}): each matrix stored in a key's type comes rounded into its value's
    (`requantized`). reader: the file already open (`open_file`)."""
    reader = open_file(path) if reader is None else reader
    check_requantize(requantize or {})
    for raw in stored(reader, config_of(reader, Path(path).name)):
        to = (requantize or {}).get(raw.type)
        yield raw if to is None or len(raw.shape) != 2 else requantized(raw, to)


def check_requantize(requantize: dict[str, str]) -> None:
    """Each type of a requantize map is a GGML type, each target one the `gguf` package quantizes."""
    from gguf import GGMLQuantizationType

    for name in {*requantize, *requantize.values()}:
        if name not in GGMLQuantizationType.__members__:
            raise SpecdecError(f"{name!r} is not a GGML tensor type (e.g. Q4_1, Q5_0, Q8_0)")
    for name in set(requantize.values()):
        if not handled(GGMLQuantizationType[name], "quantize"):
            raise SpecdecError(f"the gguf package cannot quantize into {name}: requantize into one it "
                               "quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)")


def requantized(raw: RawTensor, to: str) -> RawTensor:
    """A matrix's blocks rounded into GGML type `to` from the values the file stores (gguf's own
    quantizer, row by row: each row's blocks depend on that row only)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    block = GGML_QUANT_SIZES[GGMLQuantizationType[to]][0]
    if raw.shape[-1] % block:
        raise SpecdecError(f"GGUF tensor {raw.gguf_name} has rows of {raw.shape[-1]} values, not a whole number "
                           f"of {to}'s blocks of {block}: it cannot be requantized into {to}")
    values = dequantize(raw.data, GGMLQuantizationType[raw.type]).reshape(raw.shape).astype(np.float32)
    return RawTensor(raw.name, raw.gguf_name, to, raw.shape, quantize(values, GGMLQuantizationType[to]))


def stored(reader, config: dict) -> Iterator[RawTensor]:
    """The tensors of an open file (`open_file`) whose config `config_of` gave (see raw_tensors)."""
    for t in reader.tensors:
        name = hf_name(t.name, config["model_type"])
        if name is None:
            if t.name == ROPE_FREQS:
                continue
            why = ("Phi-3's longrope factors, which specdec does not read from a GGUF (load the model's "
                   "transformers folder instead)" if t.name.startswith("rope_factors_") else
                   f"specdec's {config['model_type']} has no such weight")
            raise SpecdecError(f"GGUF tensor {t.name!r} is refused: {why}")
        data, kind, shape = t.data, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape))
        if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            data = unpermute(data, heads)
        if config["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norms as 1 + w; specdec, as transformers, holds w (and computes 1 + w)
            values = dequantized(RawTensor(name, t.name, kind, shape, data)).numpy()
            data, kind = np.asarray(values - 1, np.float32), "F32"
        yield RawTensor(name, t.name, kind, shape, data)


def handled(qtype, step: str) -> bool:
    """Whether the `gguf` package can `step` ("quantize" or "dequantize") this GGML type (tried on one
    zero block: of floats to quantize, of bytes to dequantize)."""
    from gguf import GGML_QUANT_SIZES, quants

    block, size = GGML_QUANT_SIZES[qtype]
    zeros = np.zeros((1, block), np.float32) if step == "quantize" else np.zeros((1, size), np.uint8)
    try:
        getattr(quants, step)(zeros, qtype)
    except NotImplementedError:
        return False
    return True


def check_types(reader, where: str) -> None:
    types = {t.tensor_type: t.name for t in reader.tensors}
    refused = sorted(f"{qtype.name} (e.g. {name})" for qtype, name in types.items() if not handled(qtype, "dequantize"))
    if refused:
        raise SpecdecError(f"{where}: the tensor type(s) {', '.join(refused)} cannot be read: the gguf package "
                           "does not dequantize them; convert the file with another quantization")


def dequantized(raw: RawTensor, matrices: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A raw tensor's values: matrices in `matrices` (bfloat16: the converted checkpoint's; float32: the
    file's values exactly), vectors (norms, biases) in float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = torch.from_numpy(np.array(dequantize(raw.data, GGMLQuantizationType[raw.type])))  # a writable copy
    values = values.reshape(raw.shape)
    return values.to(matrices if values.dim() > 1 else torch.float32).contiguous()


def tokenizer(path: str | Path, reader=None) -> Tokenizer:
    """The file's tokenizer, built in memory from its metadata (`hf_tokenizer`), with llama.cpp's
    prompt rules: its BOS first where the file says so (`adds_bos`), its end-of-generation set
    (`end_ids`) ending a generation; its chat template rendered by transformers. reader: the file
    already open (`open_file`)."""
    path = Path(path)
    reader = open_file(path) if reader is None else reader
    config = config_of(reader, path.name)
    hf = hf_tokenizer(path)
    settings = {"bos_token": hf.bos_token, "eos_token": hf.eos_token, "add_bos_token": adds_bos(reader)}
    # its backend, once: the chat renders with a copy of hf, made when first needed (Tokenizer.held)
    return Tokenizer.held(hf.backend_tokenizer, hf, settings, config, path.name)


def hf_tokenizer(path: Path):
    """The transformers tokenizer of the file's metadata (vocabulary, merges, special tokens, chat
    template), built in memory by transformers' own GGUF tokenizer converter: what
    AutoTokenizer.from_pretrained(..., gguf_file=...) builds, without the rest of that loading."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, vocabulary, settings = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)
    except (ValueError, KeyError, OSError, TypeError, IndexError) as e:
        raise SpecdecError(f"{path.name}: transformers cannot build its tokenizer from the metadata ({e})") from None
    hf.name_or_path = path.stem
    return hf


def adds_bos(reader) -> bool:
    """llama.cpp's rule, as transformers reads it: a prompt starts with the BOS where the metadata says
    so, and a sentencepiece vocabulary without the flag adds one."""
    return bool(field(reader, "tokenizer.ggml.add_bos_token", field(reader, "tokenizer.ggml.model") == "llama"))


def converted(path: str | Path, reader=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json's keys, the tensors) of the file's conversion, in memory: every tensor dequantized,
    matrices in bfloat16, norms and biases in float32 (`dequantized`), checked against the architecture
    its metadata describes; what `convert` writes to a folder. reader: the file already open."""
    from .arch import resolve

    path = Path(path)
    reader = open_file(path) if reader is None else reader
    config = config_of(reader, path.name)
    arch = resolve(config, where=path.name)
    check_types(reader, path.name)
    state = {raw.name: dequantized(raw) for raw in stored(reader, config)}
    check_weights({name: tuple(value.shape) for name, value in state.items()}, arch, path.name)
    return config, state


def weights_sha256(path: str | Path) -> str:
    """The sha256 of a target's weights, as the heads and parallel drafts trained for it record it: a
    folder's model.safetensors; a .gguf file's conversion's (the model.safetensors `folder` writes),
    without writing it: read from the cached folder where there is one, else the conversion serialized
    in memory; kept in the cache's index under the file's sha256 (INDEX_SIZE files), so that the file's
    hash alone finds it next time."""
    path = Path(path)
    if not is_gguf(path):
        if not (path / WEIGHTS).exists():
            raise SpecdecError(f"{path} has no {WEIGHTS}: pass the target's checkpoint folder or .gguf file")
        return sha256(path / WEIGHTS)
    key = file_sha256(path)
    index = read_index()
    if key not in index:
        cached = cache_root() / f"{key[:16]}-v{FORMAT}" / path.stem / WEIGHTS
        if cached.is_file():
            index[key] = sha256(cached)
        else:
            from safetensors.torch import save

            index[key] = hashlib.sha256(save(converted(path)[1], metadata={"format": "pt"})).hexdigest()
        write_index(index)
    return index[key]


def file_sha256(path: Path) -> str:
    """The file's sha256, hashed once per process while its size and modification time stay the same."""
    stat = path.stat()
    return _hashed(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _hashed(path: str, size: int, modified: int) -> str:
    return sha256(path)


def read_index() -> dict[str, str]:
    """The cache's index, {a .gguf file's sha256: its conversion's weights' sha256} (empty where none)."""
    try:
        index = json.loads((cache_root() / INDEX).read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError:  # a torn write of another process: the entries are made again when asked
        return {}
    return index if isinstance(index, dict) else {}


def write_index(index: dict[str, str]) -> None:
    """Write the index, its INDEX_SIZE most recent entries, atomically (renamed into place)."""
    file = cache_root() / INDEX
    tmp = file.with_name(f".{INDEX}.tmp-{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(dict(list(index.items())[-INDEX_SIZE:]), indent=1) + "\n")
        os.replace(tmp, file)
    except OSError as e:
        raise write_error(file, e) from None


def target_config(path: str | Path) -> dict:
    """A target's config.json keys: a folder's file, a .gguf file's metadata (`config_of`)."""
    from .checkpoint import read_config

    path = Path(path)
    return config_of(open_file(path), path.name) if is_gguf(path) else read_config(path)


def checkpoint(path: str | Path) -> Path:
    """A checkpoint folder as given, or a .gguf file's converted folder (`folder`: written on first use):
    for what needs a transformers folder (transformers itself, llama.cpp's converter, training, a head
    trained for the conversion)."""
    return folder(path) if is_gguf(path) else Path(path)


def entry(path: Path) -> Path:
    """The file's entry in the cache, keyed by its sha256 (cache_root()/SHA256-vFORMAT): its converted
    folder and what else is made from it when asked (a draft's token counts), marked as just used; the
    cache keeps KEEP entries (`evict`)."""
    where = cache_root() / f"{file_sha256(path)[:16]}-v{FORMAT}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        os.utime(where)
    except OSError as e:
        raise write_error(where, e) from None
    evict(where)
    return where


def evict(keep: Path) -> None:
    """Remove the cache's entries beyond the KEEP most recently used (`keep` among them), entries of an
    older FORMAT first."""
    def used(entry: Path) -> tuple[bool, float]:
        try:
            return entry.name.endswith(f"-v{FORMAT}"), entry.stat().st_mtime
        except FileNotFoundError:  # another process removed it meanwhile
            return False, 0.0
    others = [p for p in keep.parent.iterdir() if p.is_dir() and p != keep]
    for stale in sorted(others, key=used, reverse=True)[KEEP - 1:]:
        try:
            shutil.rmtree(stale)
        except FileNotFoundError:  # another process removed it meanwhile
            continue


def folder(path: str | Path) -> Path:
    """The checkpoint folder of the GGUF file at `path`, converted on first use."""
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"no GGUF file at {path}: pass --model with an existing .gguf file or a checkpoint folder")
    dest = entry(path) / path.stem  # named as the file: the model's name
    recover(dest)
    if (dest / CONFIG).exists():  # a folder appears there complete (renamed last) or not at all
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(dest, e) from None
    # the first use converts; the others wait for it, then find the folder
    with exclusive(dest, waiting=f"specdec: waiting for another process converting {path.name} ({dest})"):
        if not (dest / CONFIG).exists():
            convert(path, dest)
    return dest


def convert(path: Path, dest: Path) -> None:
    """Write the checkpoint folder of the GGUF at `path` to `dest` (atomically)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .arch import resolve

    reader = open_file(path)
    config = config_of(reader, path.name)
    arch = resolve(config, where=path.name)
    check_types(reader, path.name)
    print(f"converting {path.name} to a checkpoint folder, once: {dest}", file=sys.stderr)
    with atomic_dir(dest) as tmp:
        state = {}
        for raw in tqdm(stored(reader, config), total=len(reader.tensors), desc="dequantizing", unit="tensor",
                        file=sys.stderr):
            state[raw.name] = dequantized(raw)
        check_weights({name: tuple(value.shape) for name, value in state.items()}, arch, path.name)
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt"})
        del state
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(path, reader, tmp)
        source = {"file": path.name, "path": str(path.resolve()), "sha256": sha256(path), "format": FORMAT}
        (tmp / META).write_text(json.dumps({"converted_from": source}, indent=2) + "\n")


def check_weights(shapes: dict[str, tuple[int, ...]], arch, where: str) -> None:
    """Refuse a file whose tensors ({transformers name: shape}) are not those of the architecture its
    metadata describes."""
    from .model import LlamaForCausalLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in LlamaForCausalLM(arch).hf_state_dict().items()}
    got = {k: v for k, v in shapes.items() if not (arch.tie_word_embeddings and k == "lm_head.weight")}
    if expected != got:
        missing = sorted(set(expected) - set(got))[:3]
        wrong = [f"{k}: {got[k]}, not {expected[k]}" for k in expected if k in got and got[k] != expected[k]][:3]
        raise SpecdecError(f"{where}: the tensors do not match the architecture its metadata describes (missing "
                           f"{missing}, wrong shapes {wrong}); the file is corrupt or of another model")


def write_tokenizer(path: Path, reader, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (BOS, EOS, add_bos_token) and the chat template of the
    tokenizer `hf_tokenizer` builds from the metadata (the one `tokenizer` holds in memory)."""
    hf_tokenizer(path).save_pretrained(str(out))
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["add_bos_token"] = adds_bos(reader)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
