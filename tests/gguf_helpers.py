"""Small GGUF files written here with the `gguf` package from small transformers models, as
llama.cpp's convert_hf_to_gguf.py writes them: its tensor names, Llama's q/k row permutation, norms
and biases in F32 and the matrices in the types given (F32, F16, BF16, Q8_0, Q4_0, Q4_1 by default,
cycled so every type occurs; the K-quants, which gguf.quants cannot make, by `quantize_any`), a
byte-level BPE tokenizer with its special tokens marked as control tokens; Gemma 3 with its norms
stored plus 1 and its window in the metadata, as convert_hf_to_gguf.py writes it. Nothing is downloaded."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

Q = GGMLQuantizationType
TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16, Q.F32)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = 320  # 256 bytes, the merges, the specials last (so that the EOS id is not 2)
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SIZES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on a few standard-library files, its special tokens last."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("json/encoder.py", "textwrap.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIALS), show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(list(SPECIALS))
    assert tok.get_vocab_size() == VOCAB
    return tok


CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}


def hf_model(family: str, seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """A random transformers model of the family (norms and biases random too), its values in bf16
    (Gemma's norms, which scale by 1 + w, around 0)."""
    config_class, model_class = CLASSES[family]
    config = config_class(**{**SIZES, **changes})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    center = 0.0 if family == "gemma3" else 1.0
    with torch.no_grad():
        for p in model.parameters():
            spread, mean = (0.3, center) if p.dim() == 1 else (0.1, 0.0)
            p.copy_((torch.randn_like(p) * spread + mean).bfloat16())
    return model


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a Llama q or k projection's rows (convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(state: dict, arch: str = "llama") -> dict[str, str]:
    """transformers name -> llama.cpp's (Gemma 3's four norms a layer by their own names)."""
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
             "mlp.gate_up_proj": "ffn_up"}
    if arch == "gemma3":
        parts.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    for name in state:
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            stem, kind = ".".join(rest[:-1]), rest[-1]
            out[name] = f"blk.{layer}.{parts[stem]}.{kind}"
    return out


def write_gguf(path: Path, model, tok: Tokenizer, arch: str, types=TYPES, add_bos: bool = False,
               bos: str | None = "<|endoftext|>", eos: str = "<|im_end|>", extra=None,
               model_name: str = "tiny test model") -> Path:
    """The model and tokenizer as a GGUF file of `arch`; `extra(writer)` may add metadata or tensors."""
    cfg = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    w = GGUFWriter(str(path), arch)
    w.add_name(model_name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3's global layers'
    w.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes them
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(cfg.max_position_embeddings)
        if cfg.sliding_window is not None:
            w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3" and cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    add_tokenizer(w, tok, add_bos, bos, eos)
    if extra is not None:
        extra(w)
    matrices = 0
    for name, gguf_name in gguf_names(state, arch).items():
        if name not in state:
            continue
        value = state[name]
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1  # llama.cpp stores Gemma's norms as 1 + w
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = permute(value, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = permute(value, cfg.num_key_value_heads)
        qtype = Q.F32 if value.ndim == 1 else types[matrices % len(types)]
        matrices += value.ndim > 1
        data = quantize_any(np.ascontiguousarray(value, dtype=np.float32), qtype)
        w.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize_any(w: np.ndarray, qtype) -> np.ndarray:
    """gguf.quants.quantize, and for the K-quants, IQ4_NL and IQ4_XS (which it cannot make) blocks built
    here following GGUF's layout (plain rounding, not llama.cpp's search for the best scales)."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        return q4_k_by_hand(w, fifth=qtype == Q.Q5_K)
    if qtype == Q.Q6_K:
        return q6_k_by_hand(w)
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):
        return iq4_by_hand(w, qtype == Q.IQ4_XS)
    if qtype == Q.Q3_K:
        return q3_k_by_hand(w)
    if qtype == Q.Q2_K:
        return q2_k_by_hand(w)
    return quantize(w, qtype)


def _nearest(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)


def q4_k_by_hand(w: np.ndarray, fifth: bool = False) -> np.ndarray:
    """(N, K) fp32, K a multiple of 256 -> (N, K/256 * 144) bytes of Q4_K: per sub-block of 32 its
    range as a 6-bit scale and min of the super-block's d and dmin, 4-bit codes; `fifth`: (N, K/256 * 176)
    bytes of Q5_K, 5-bit codes whose fifth bits come before the nibbles (k 32c + j's: bit c of byte j)."""
    N, K = w.shape
    top = 31 if fifth else 15
    x = w.reshape(N, K // 256, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0)  # (N, S, 8)
    scale = (x.max(-1) - low) / top
    d = (scale.max(-1) / 63).astype(np.float16)  # (N, S)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    inv = lambda a: np.divide(1, a, out=np.zeros_like(a), where=a != 0)  # noqa: E731
    sc = np.clip(_nearest(scale * inv(d.astype(np.float32))[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(_nearest(-low * inv(dmin.astype(np.float32))[..., None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    u = np.clip(_nearest((x + (dmin.astype(np.float32)[..., None] * m)[..., None]) * inv(step)[..., None]), 0, top)
    u = u.astype(np.uint8)
    qh = sum((u[:, :, c] >> 4) << c for c in range(8)).astype(np.uint8)  # (N, S, 32)
    u = (u & 15).reshape(N, K // 256, 4, 2, 32)  # chunk c: k 64c..64c+31, then 64c+32..
    qs = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).reshape(N, K // 256, 128)
    if fifth:
        qs = np.concatenate([qh, qs], axis=-1)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)  # (N, S, 12)
    head = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)], axis=-1)
    return np.concatenate([head, packed, qs], axis=-1).reshape(N, -1)


def q6_k_by_hand(w: np.ndarray) -> np.ndarray:
    """(N, K) fp32, K a multiple of 256 -> (N, K/256 * 210) bytes of Q6_K: per sub-block of 16 an int8
    scale of the super-block's d, 6-bit codes u = round(x / (d sc)) + 32."""
    N, K = w.shape
    x = w.reshape(N, K // 256, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31  # (N, S, 16)
    d = (scale.max(-1) / 127).astype(np.float16)
    inv = lambda a: np.divide(1, a, out=np.zeros_like(a), where=a != 0)  # noqa: E731
    sc = np.clip(_nearest(scale * inv(d.astype(np.float32))[..., None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[..., None] * sc
    u = np.clip(_nearest(x * inv(step)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(N, K // 256, 2, 4, 32)
    ql = np.concatenate([(u[:, :, :, 0] & 15) | ((u[:, :, :, 2] & 15) << 4),
                         (u[:, :, :, 1] & 15) | ((u[:, :, :, 3] & 15) << 4)], axis=-1)  # (N, S, 2, 64)
    qh = (u[:, :, :, 0] >> 4) | ((u[:, :, :, 1] >> 4) << 2) | ((u[:, :, :, 2] >> 4) << 4) | ((u[:, :, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(N, -1, 128), qh.reshape(N, -1, 64), sc.view(np.uint8),
                           d[..., None].view(np.uint8)], axis=-1).reshape(N, -1)


def _low_bit_planes(u: np.ndarray) -> np.ndarray:
    """(N, S, 256) codes -> (N, S, 64) bytes of their low 2 bits: k 128h + 32j + b's in bits 2j, 2j+1 of
    byte 32h + b."""
    u = (u & 3).reshape(*u.shape[:2], 2, 4, 32)
    return sum(u[:, :, :, j] << (2 * j) for j in range(4)).astype(np.uint8).reshape(*u.shape[:2], 64)


def q3_k_by_hand(w: np.ndarray) -> np.ndarray:
    """(N, K) fp32, K a multiple of 256 -> (N, K/256 * 110) bytes of Q3_K: per sub-block of 16 the scale
    that takes its weight of largest magnitude to -4, as a 6-bit sc - 32 of the super-block's d; codes
    u = round(w / (d sc)) + 4 in 0..7."""
    N, K = w.shape
    x = w.reshape(N, K // 256, 16, 16).astype(np.float32)
    scale = -np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0] / 4  # (N, S, 16)
    d = (np.abs(scale).max(-1) / 31).astype(np.float16)
    inv = lambda a: np.divide(1, a, out=np.zeros_like(a), where=a != 0)  # noqa: E731
    sc = np.clip(_nearest(scale * inv(d.astype(np.float32))[..., None]), -32, 31).astype(np.int64)
    step = d.astype(np.float32)[..., None] * sc
    u = np.clip(_nearest(x * inv(step)[..., None]) + 4, 0, 7).astype(np.uint8).reshape(N, K // 256, 256)
    hmask = sum((u.reshape(N, -1, 8, 32)[:, :, j] >> 2) << j for j in range(8)).astype(np.uint8)  # (N, S, 32)
    six = (sc + 32).astype(np.uint8)
    low = (six[..., :8] & 15) | ((six[..., 8:] & 15) << 4)
    high = sum(((six[..., 4 * g:4 * g + 4] >> 4) & 3) << (2 * g) for g in range(4)).astype(np.uint8)
    return np.concatenate([hmask, _low_bit_planes(u), low, high, d[..., None].view(np.uint8)], axis=-1).reshape(N, -1)


def q2_k_by_hand(w: np.ndarray) -> np.ndarray:
    """(N, K) fp32, K a multiple of 256 -> (N, K/256 * 84) bytes of Q2_K: per sub-block of 16 its range as
    4-bit sc and m of the super-block's d and dmin, 2-bit codes."""
    N, K = w.shape
    x = w.reshape(N, K // 256, 16, 16).astype(np.float32)
    low = np.minimum(x.min(-1), 0)  # (N, S, 16)
    scale = (x.max(-1) - low) / 3
    d, dmin = (scale.max(-1) / 15).astype(np.float16), (-low.min(-1) / 15).astype(np.float16)
    inv = lambda a: np.divide(1, a, out=np.zeros_like(a), where=a != 0)  # noqa: E731
    sc = np.clip(_nearest(scale * inv(d.astype(np.float32))[..., None]), 0, 15).astype(np.uint8)
    m = np.clip(_nearest(-low * inv(dmin.astype(np.float32))[..., None]), 0, 15).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    u = np.clip(_nearest((x + (dmin.astype(np.float32)[..., None] * m)[..., None]) * inv(step)[..., None]), 0, 3)
    u = u.astype(np.uint8).reshape(N, K // 256, 256)
    return np.concatenate([sc | (m << 4), _low_bit_planes(u), d[..., None].view(np.uint8),
                           dmin[..., None].view(np.uint8)], axis=-1).reshape(N, -1)


IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def iq4_by_hand(w: np.ndarray, xs: bool) -> np.ndarray:
    """(N, K) fp32 -> IQ4_NL bytes (N, K/32 * 18): per block of 32 d = -w' / 127 (w' its weight of largest
    magnitude, which becomes the level -127) and each weight's nearest level; or (xs, K a multiple of 256)
    IQ4_XS bytes (N, K/256 * 136): per sub-block of 32 that scale as the 6-bit ls - 32 of the super-block's d."""
    N, K = w.shape
    x = w.reshape(N, -1, 32).astype(np.float32)
    scale = -np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0] / 127  # (N, K/32)
    inv = lambda a: np.divide(1, a, out=np.zeros_like(a), where=a != 0)  # noqa: E731
    if xs:
        scale = scale.reshape(N, K // 256, 8)
        d = (np.abs(scale).max(-1) / 31).astype(np.float16)  # (N, S)
        ls = np.clip(_nearest(scale * inv(d.astype(np.float32))[..., None]), -32, 31).astype(np.int64)  # (N, S, 8)
        step = (d.astype(np.float32)[..., None] * ls).reshape(N, -1)
    else:
        d = scale.astype(np.float16)
        step = d.astype(np.float32)
    u = np.abs(x * inv(step)[..., None] - IQ4_LEVELS[:, None, None, None]).argmin(0).astype(np.uint8)  # (N, B, 32)
    qs = u[..., :16] | (u[..., 16:] << 4)  # (N, K/32, 16)
    if not xs:
        return np.concatenate([d[..., None].view(np.uint8), qs], axis=-1).reshape(N, -1)
    six, c = ls + 32, np.arange(8)
    high = ((six >> 4) << (2 * c)).sum(-1).astype(np.uint16)  # (N, S)
    low = ((six & 15) << (4 * c)).sum(-1).astype(np.uint32)
    return np.concatenate([d[..., None].view(np.uint8), high[..., None].view(np.uint8), low[..., None].view(np.uint8),
                           qs.reshape(N, K // 256, 128)], axis=-1).reshape(N, -1)


def add_tokenizer(w: GGUFWriter, tok: Tokenizer, add_bos: bool, bos: str | None, eos: str) -> None:
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(tok.token_to_id(bos))
    w.add_eos_token_id(tok.token_to_id(eos))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
