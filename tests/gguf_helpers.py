"""Small GGUF files written here with the `gguf` package from small transformers models, as
llama.cpp's convert_hf_to_gguf.py writes them: its tensor names, Llama's q/k row permutation, norms
and biases in F32 and the matrices in the types given (F32, F16, BF16, Q8_0, Q4_0, Q4_1 by default,
cycled so every type occurs), a byte-level BPE tokenizer with its special tokens marked as control
tokens. Nothing is downloaded."""
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


def hf_model(family: str, seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """A random transformers model of the family (norms and biases random too), its values in bf16."""
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
              "phi3": transformers.Phi3Config}[family](**{**SIZES, **changes})
    torch.manual_seed(seed)
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
             "qwen3": transformers.Qwen3ForCausalLM, "phi3": transformers.Phi3ForCausalLM}[family](config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0)).bfloat16())
    return model


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a Llama q or k projection's rows (convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(state: dict) -> dict[str, str]:
    """transformers name -> llama.cpp's."""
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
             "mlp.gate_up_proj": "ffn_up"}
    for name in state:
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            stem, kind = ".".join(rest[:-1]), rest[-1]
            out[name] = f"blk.{layer}.{parts[stem]}.{kind}"
    return out


def write_gguf(path: Path, model, tok: Tokenizer, arch: str, types=TYPES, add_bos: bool = False,
               bos: str | None = "<|endoftext|>", eos: str = "<|im_end|>", extra=None) -> Path:
    """The model and tokenizer as a GGUF file of `arch`; `extra(writer)` may add metadata or tensors."""
    cfg = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes them
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(cfg.max_position_embeddings)
        if cfg.sliding_window is not None:
            w.add_sliding_window(cfg.sliding_window)
    add_tokenizer(w, tok, add_bos, bos, eos)
    if extra is not None:
        extra(w)
    matrices = 0
    for name, gguf_name in gguf_names(state).items():
        if name not in state:
            continue
        value = state[name]
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = permute(value, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = permute(value, cfg.num_key_value_heads)
        qtype = Q.F32 if value.ndim == 1 else types[matrices % len(types)]
        matrices += value.ndim > 1
        data = quantize(np.ascontiguousarray(value, dtype=np.float32), qtype)
        w.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tokenizer(w: GGUFWriter, tok: Tokenizer, add_bos: bool, bos: str | None, eos: str) -> None:
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control
    w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(tok.token_to_id(bos))
    w.add_eos_token_id(tok.token_to_id(eos))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
