"""llama.cpp as a peer: a specdec checkpoint converted to GGUF, and llama.cpp's own greedy decoding
of it through the `llama-cpp-python` binding (the optional extra `pip install -e '.[llamacpp]'`).

Conversion (needs only the pure-Python `gguf` package): the checkpoint's safetensors in the
layout of transformers' `LlamaForCausalLM` become a GGUF file in bf16 (matrices as stored, the
1-D norm weights in f32 as llama.cpp wants them) or f32 (every bf16 value upcast exactly). The
files go to a cache folder named by the weights' sha256, never into the repository. Rotary
layout: transformers' Llama rotates the two halves of each head (dimension i with i + d/2);
llama.cpp's Llama rotates adjacent pairs (2i with 2i+1). So the rows of q_proj and k_proj are
reordered per head from [halves] to [pairs]; q . k is unchanged, and so are the logits.

The vocabulary is written in full (model "gpt2", byte-level tokens, merges, token types,
bos/eos ids) so that the file loads anywhere, but the decoders here feed token ids directly:
llama.cpp and specdec decode the very same ids, no text round trip.

Decoding: prompt evaluation and token-by-token decoding are timed apart; the next token is
llama.cpp's greedy sampler (argmax, in C). EOS does not stop it: like specdec's plain decoder in
`bench plain`, it produces exactly max_new_tokens tokens per prompt. The f32 file runs in
specdec's arithmetic (f32 KV cache, no flash attention: logits within ~2e-5 of specdec's on the
shipped target), the bf16 file in llama.cpp's defaults (see PEER_SETTINGS).

This module knows nothing about specdec's model classes or the benchmark's report.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from ..errors import SpecdecError
from ..lm.checkpoint import CONFIG, TOKENIZER, WEIGHTS, sha256

CONVERTER_VERSION = 1  # part of the cached file's name: a change of the conversion invalidates the cache
GGUF_DTYPES = ("bf16", "f32", "q8_0")  # q8_0: llama.cpp's own quantization of the bf16 file (needs llama-cpp-python)
LLAMA_FTYPE_MOSTLY_Q8_0 = 7  # llama_ftype
INSTALL_HINT = "pip install -e '.[llamacpp]' (builds llama.cpp from source, ~10 min on 2 cores)"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec" / "gguf"


def available() -> str | None:
    """llama-cpp-python's version, or None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_heads * d, C) rows per head [x_0..x_{d/2-1}, y_0..y_{d/2-1}] -> [x_0, y_0, x_1, y_1, ...]."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None


def read_vocab(folder: Path, n_vocab: int) -> Vocab:
    """The byte-level BPE of tokenizer.json, padded with unused entries up to the model's rows."""
    import gguf

    try:
        tok = json.loads((folder / TOKENIZER).read_text())
    except FileNotFoundError:
        raise SpecdecError(f"{folder} has no {TOKENIZER}; GGUF needs the vocabulary to load") from None
    model = tok["model"]
    if model.get("type") != "BPE":
        raise SpecdecError(f"{folder / TOKENIZER} holds a {model.get('type')} tokenizer; only byte-level BPE "
                           "(specdec's) converts to GGUF here")
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    by_id.update(special)
    if max(by_id) >= n_vocab:
        raise SpecdecError(f"{folder / TOKENIZER} has token id {max(by_id)} but the model only {n_vocab} rows")
    tokens, types = [], []
    for i in range(n_vocab):
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ids = {t: i for i, t in special.items()}
    return Vocab(tokens, types, merges, ids.get("<|bos|>"), ids.get("<|endoftext|>"), ids.get("<|pad|>"))


def gguf_path(checkpoint: str | Path, dtype: str, cache: Path | None = None) -> Path:
    """Where the conversion of `checkpoint` in `dtype` lives: <cache>/<weights sha256>/model-<dtype>.gguf."""
    if dtype not in GGUF_DTYPES:
        raise SpecdecError(f"GGUF dtype {dtype!r}: choose one of {', '.join(GGUF_DTYPES)}")
    digest = sha256(Path(checkpoint) / WEIGHTS)
    return (cache or cache_root()) / digest / f"model-{dtype}-v{CONVERTER_VERSION}.gguf"


def convert(checkpoint: str | Path, dtype: str = "bf16", cache: Path | None = None) -> Path:
    """The GGUF file of `checkpoint` in `dtype`, converted once and then read from the cache."""
    checkpoint = Path(checkpoint)
    out = gguf_path(checkpoint, dtype, cache)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            if dtype == "q8_0":
                quantize(convert(checkpoint, "bf16", cache), tmp, LLAMA_FTYPE_MOSTLY_Q8_0)
            else:
                write_gguf(checkpoint, tmp, dtype)
            os.replace(tmp, out)  # a reader never sees a half-written file
        finally:
            tmp.unlink(missing_ok=True)
    return out


def quantize(source: Path, out: Path, ftype: int) -> None:
    """llama.cpp's quantization of a GGUF file (llama_model_quantize), on torch's threads."""
    import llama_cpp as lc

    _silence_llama_cpp(lc)
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, torch.get_num_threads()
    if lc.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise SpecdecError(f"llama.cpp could not quantize {source} ({_why()})")


def write_gguf(checkpoint: Path, out: Path, dtype: str) -> None:
    import gguf

    cfg = json.loads((checkpoint / CONFIG).read_text())
    if cfg.get("model_type") != "llama":
        raise SpecdecError(f"{checkpoint} holds a {cfg.get('model_type')!r} model; only Llama checkpoints convert")
    n_layers, n_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise SpecdecError(f"{checkpoint}: rope_type {rope['rope_type']!r} is not converted (only the default)")
    state = load_file(checkpoint / WEIGHTS)
    vocab = read_vocab(checkpoint, cfg["vocab_size"])

    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    w.add_name(checkpoint.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bf16" else gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(n_layers)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the ByteLevel pre-tokenizer splits with GPT-2's regex
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    for add, token_id in ((w.add_bos_token_id, vocab.bos_id), (w.add_eos_token_id, vocab.eos_id),
                          (w.add_pad_token_id, vocab.pad_id)):
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(False)  # specdec's prompts start with <|endoftext|>, added by the caller

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    for hf_name, t in state.items():
        if hf_name.endswith("q_proj.weight"):
            t = permute_rotary(t, n_heads)
        elif hf_name.endswith("k_proj.weight"):
            t = permute_rotary(t, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            raise SpecdecError(f"{checkpoint / WEIGHTS}: tensor {hf_name} has no GGUF name for a Llama model")
        if t.dim() == 1 or dtype == "f32":  # llama.cpp keeps norm weights in f32
            w.add_tensor(name, t.float().numpy())
        else:
            w.add_tensor(name, t.to(torch.bfloat16).contiguous().view(torch.int16).numpy(),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids of the KV cache (GGML_TYPE_F32, GGML_TYPE_F16)
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
# How each GGUF file runs as a peer: f32 in specdec's arithmetic (fp32 everywhere; llama.cpp's CPU
# flash attention rounds through f16, ~1e-3 on the logits, so it is off), bf16 in llama.cpp's
# defaults (f16 KV cache, flash attention as llama.cpp decides) — its fast setting.
PEER_SETTINGS = {"f32": {"kv": "f32", "flash_attn": "off"}, "bf16": {"kv": "f16", "flash_attn": "auto"},
                 "q8_0": {"kv": "f16", "flash_attn": "auto"}}
LOG_ERROR = 4  # ggml_log_level GGML_LOG_LEVEL_ERROR
_quiet_log = None  # the C logging callback must outlive every call that may log
_errors: deque[str] = deque(maxlen=8)  # llama.cpp's latest error lines, for our error messages


def _keep_errors(level: int, text: bytes, user_data) -> None:
    if level == LOG_ERROR:
        _errors.append(text.decode(errors="replace").strip())


def _silence_llama_cpp(lc) -> None:
    """Keep llama.cpp's load-time chatter (hundreds of lines per model) off the terminal; its
    error lines are kept for the message of the SpecdecError that follows them."""
    global _quiet_log
    if _quiet_log is None:
        _quiet_log = lc.llama_log_callback(_keep_errors)
        lc.llama_log_set(_quiet_log, None)


def _why() -> str:
    return "; ".join(_errors) or "llama.cpp logged no error"


class LlamaCppModel:
    """One GGUF model and context of llama.cpp, fed token ids directly (no tokenizer round trip).

    The KV cache holds `kv` values (f32: specdec's arithmetic; f16: llama.cpp's default); flash
    attention is "auto" (llama.cpp's default), "off" or "on". Each `generate` or `logits` call
    starts from an empty cache."""

    def __init__(self, path: str | Path, n_threads: int, n_ctx: int, kv: str = "f32", flash_attn: str = "off"):
        import llama_cpp as lc

        self.lc, self.path, self.n_threads = lc, Path(path), n_threads
        self.kv, self.flash_attn = kv, flash_attn
        _silence_llama_cpp(lc)
        _errors.clear()
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise SpecdecError(f"llama.cpp could not load {path} ({_why()}); delete the file to convert again")
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx   # a whole prompt is one batch
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.type_k = cp.type_v = KV_TYPES[kv]
        cp.flash_attn_type = FLASH_ATTN[flash_attn]
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise SpecdecError(f"llama.cpp could not create a context for {path} (n_ctx={n_ctx}: {_why()})")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.greedy = lc.llama_sampler_init_greedy()

    def close(self) -> None:
        self.lc.llama_sampler_free(self.greedy)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _reset(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def _decode(self, ids: list[int]) -> None:
        tokens = (self.lc.llama_token * len(ids))(*ids)
        if self.lc.llama_decode(self.ctx, self.lc.llama_batch_get_one(tokens, len(ids))) != 0:
            raise SpecdecError(f"llama.cpp failed to decode {len(ids)} tokens with {self.path}")

    def logits(self, ids: list[int]) -> np.ndarray:
        """(T, V) logits of every position of `ids`, one forward over the whole sequence."""
        lc = self.lc
        self._reset()
        batch = lc.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
                batch.seq_id[i][0] = 0
            if lc.llama_decode(self.ctx, batch) != 0:
                raise SpecdecError(f"llama.cpp failed to decode {len(ids)} tokens with {self.path}")
            out = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(len(ids) * self.n_vocab,))
            return out.reshape(len(ids), self.n_vocab).copy()
        finally:
            lc.llama_batch_free(batch)

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """Greedy decoding of exactly `max_new_tokens` tokens (EOS does not stop it).
        Returns the tokens, the prompt-evaluation seconds (prompt forward and the first token)
        and the decode seconds (one forward per further token)."""
        if max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be >= 1 for llama.cpp's decoding, got {max_new_tokens}")
        lc, ctx, greedy = self.lc, self.ctx, self.greedy
        self._reset()
        t0 = time.perf_counter()
        self._decode(ids)
        out = [lc.llama_sampler_sample(greedy, ctx, -1)]
        t1 = time.perf_counter()
        one = (lc.llama_token * 1)()
        for _ in range(max_new_tokens - 1):
            one[0] = out[-1]
            if lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1)) != 0:
                raise SpecdecError(f"llama.cpp failed to decode a token with {self.path}")
            out.append(lc.llama_sampler_sample(greedy, ctx, -1))
        return out, t1 - t0, time.perf_counter() - t1


class LlamaCppLookup:
    """llama.cpp with prompt lookup decoding as its Python binding offers it: llama-cpp-python's
    `Llama` with `LlamaPromptLookupDecoding(num_pred_tokens=k)` as its draft model (n-gram matches in
    the context, verified in one batched llama.cpp forward). Greedy (temperature 0, no penalties),
    fed token ids directly; `generate` resets the context first, so no call reuses an earlier
    prompt's cache."""

    def __init__(self, path: str | Path, n_threads: int, n_ctx: int, k: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.path, self.k = Path(path), k
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads,
                         n_threads_batch=n_threads, logits_all=True, verbose=False,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))

    def close(self) -> None:
        self.llm.close()

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """As LlamaCppModel.generate: exactly `max_new_tokens` greedy tokens, the prompt-evaluation
        seconds (to the first token) and the decode seconds after it."""
        self.llm.reset()
        out, t0 = [], time.perf_counter()
        t1 = t0
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            out.append(int(token))
            if len(out) == 1:
                t1 = time.perf_counter()
            if len(out) == max_new_tokens:
                break
        return out, t1 - t0, time.perf_counter() - t1

