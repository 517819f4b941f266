"""The architecture of a decoder-only checkpoint, read strictly from its config.json at load.

One frozen `Arch` describes everything that changes a forward's arithmetic: sizes, rotary
positions (theta, scaling, partial rotary), biases, per-head q/k norms, the norm's weight offset
and the embedding scale (Gemma), the activation, tied embeddings, the checkpoint's weight layout
(Phi-3's fused projections), the usable context, and Gemma 3's layer: norms around both the
attention and the MLP, local (sliding-window) layers with their own rotary base beside global ones,
its query scale and its soft-capped logits. `Arch.from_dict` resolves a transformers
config.json for the families in FAMILIES as transformers reads it: a key transformers' modelling code
never reads is accepted (UNREAD), unless its value says the model computes otherwise (UNREAD_AS); a
key it does not implement is refused by name with the reason (never dropped: a dropped key runs a
different model), and so is an unknown `model_type`.
specdec's own models are `Arch()` with family "llama"; the CPU kernels (kernels.stack) and the
PyTorch path (model.py) are both driven by it.

This module knows nothing about weights, devices or decoding.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch

from ..errors import SpecdecError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

# Families specdec knows and refuses, with the reason (the kernels and the PyTorch path lack what they compute).
REFUSED_FAMILIES = {
    "gemma2": "Gemma 2 soft-caps its attention scores and final logits with tanh and alternates sliding-window "
              "and global layers; specdec's attention computes neither",
    "gemma3": "the multimodal Gemma 3 (a vision tower beside the text model); specdec runs its text model "
              "(model_type gemma3_text), or a Gemma 3 GGUF file",
    "mixtral": "a mixture-of-experts model: specdec's decoder layers are dense",
    "qwen2_moe": "a mixture-of-experts model: specdec's decoder layers are dense",
    "qwen3_moe": "a mixture-of-experts model: specdec's decoder layers are dense",
}

# Keys that never change the arithmetic of an inference forward (bookkeeping, dropout, decoding defaults).
INERT = {"_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache",
         "initializer_range", "pad_token_id", "attention_dropout", "resid_pdrop", "embd_pdrop", "auto_map",
         "tokenizer_class", "model_type", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
         "output_attentions", "output_hidden_states", "problem_type", "return_dict", "bos_token_id",
         "eos_token_id", "max_window_layers", "use_sliding_window", "layer_types", "original_max_position_embeddings"}
# Keys transformers' modelling code for these families never reads, so they cannot change its model:
# other libraries' settings (nanotron's is_llama_config, transformers.js's), a loader's bookkeeping
# (_model_name_or_path and unk_token_id in the folders transformers writes from a GGUF).
UNREAD = {"is_llama_config", "transformers.js_config", "_model_name_or_path", "unk_token_id"}
# Keys transformers never reads that do say how the model computes: accepted only with the value
# transformers computes with, refused by name with any other.
UNREAD_AS = {"rope_interleaved": (False, ("rotary dims interleaved in pairs (nanotron's layout); specdec and "
                                          "transformers rotate the two halves")),
             "use_mrope": (False, "multimodal rotary positions (Qwen2-VL); specdec runs text positions")}
# Keys every family reads (sizes and the rest resolved below).
READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "rope_scaling", "rope_parameters", "partial_rotary_factor", "tie_word_embeddings", "hidden_act",
        "hidden_activation", "sliding_window", "attention_bias", "mlp_bias", "pretraining_tp",
        "use_bidirectional_attention"}
# Keys only Gemma 3 reads (resolved in gemma3_settings)
GEMMA3_READ = {"query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "rope_local_base_freq",
               "sliding_window_pattern", "_sliding_window_pattern"}


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer's arithmetic. The defaults are specdec's own Llama models'."""
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024  # the context specdec runs: the config's, or its sliding window if shorter
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    # plain JSON values (a list, a dict), so that a config survives a JSON round trip unchanged
    eos_token_id: int | list[int] | None = field(default=2, hash=False)
    family: str = "llama"
    rope_scaling: dict = field(default_factory=dict, hash=False)  # a scaled RoPE's parameters, rope_type included
    partial_rotary_factor: float = 1.0   # the fraction of each head's dims that rotate (the first ones)
    qkv_bias: bool = False               # biases on q, k and v
    o_bias: bool = False                 # a bias on the attention's output projection
    mlp_bias: bool = False               # biases on gate, up and down
    qk_norm: bool = False                # RMSNorm over each head's q and k before rotation (Qwen3)
    norm_offset: float = 0.0             # norms scale by (offset + weight) (Gemma: 1)
    scale_embeddings: bool = False       # embeddings times sqrt(hidden_size) (Gemma)
    activation: str = "silu"             # of the gate: silu or gelu_tanh
    fused_checkpoint: bool = False       # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    sliding_window: int | None = None    # the config's window; the context is cut to it, unless local_layers
    # Gemma 3: the layers `local_layers` attend to the last sliding_window positions only (the context is not
    # cut), rotated with base local_rope_theta and no scaling; the others are global (rope_theta, rope_scaling)
    local_layers: tuple[int, ...] = field(default=(), hash=False)
    local_rope_theta: float | None = None
    sandwich_norms: bool = False         # norms on the attention's and the MLP's outputs too (Gemma 2, 3)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 3, where set)
    source: dict | None = field(default=None, compare=False, repr=False)  # the config.json it came from

    def __post_init__(self):
        object.__setattr__(self, "local_layers", tuple(self.local_layers))  # a list after a JSON round trip
        if self.local_layers and (self.sliding_window is None or self.local_rope_theta is None):
            raise ValueError("local layers need a sliding_window and a local_rope_theta")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or self.rotary_dim <= 0:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                             "does not give an even number of rotated dims")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be silu or gelu_tanh, not {self.activation!r}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def local_inv_freq(self) -> torch.Tensor | None:
        """(rotary_dim / 2,) fp32 the local layers' inverse frequencies (base local_rope_theta, unscaled);
        None where no layer is local."""
        if not self.local_layers:
            return None
        return Arch(head_dim=self.head_dim, partial_rotary_factor=self.partial_rotary_factor,
                    rope_theta=self.local_rope_theta).inv_freq()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every token id that ends a generation (Llama-3 ships several)."""
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (yarn's attention temperature; 1 elsewhere)."""
        rope = self.rope_scaling
        if rope.get("rope_type") not in ("yarn", "longrope"):
            return 1.0
        if rope.get("attention_factor") is not None:
            return float(rope["attention_factor"])
        factor = rope["factor"]
        if rope["rope_type"] == "longrope":
            original = rope["original_max_position_embeddings"]
            return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            return float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
        return mscale(factor)

    def inv_freq(self) -> torch.Tensor:
        """(rotary_dim / 2,) fp32 rotary inverse frequencies, as transformers computes them."""
        dim, base, rope = self.rotary_dim, self.rope_theta, self.rope_scaling
        # explicit device: also correct when the model is built under a meta-device context
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        inv_freq = 1.0 / (base ** exponents)
        kind = rope.get("rope_type", "default")
        if kind == "linear":
            return inv_freq / rope["factor"]
        if kind == "llama3":
            factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
            old = rope["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old / high) * ~(wavelen > old / low)
            return torch.where(medium, smoothed, scaled)
        if kind == "yarn":
            return _yarn_inv_freq(rope, dim, base, self.max_position_embeddings)
        if kind == "longrope":  # within original_max_position_embeddings (the context here): the short factors
            return 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32, device="cpu") * base ** exponents)
        return inv_freq  # default; dynamic equals it within max_position_embeddings (see from_dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("source")
        return d

    def network_differences(self, other: "Arch") -> dict:
        """{field: (this one's, other's)} of the fields in which two configs build different networks:
        every field but the end-of-generation ids (a checkpoint's stop set, read from its generation
        config or GGUF metadata, says when to stop, not what the network computes)."""
        theirs = other.to_dict()
        return {k: (v, theirs.get(k)) for k, v in self.to_dict().items() if k != "eos_token_id" and theirs.get(k) != v}

    @classmethod
    def from_dict(cls, d: dict) -> "Arch":
        """A transformers config.json (with `model_type`), resolved strictly; or specdec's own
        `to_dict` (no `model_type`), as draft heads record their target's."""
        if "model_type" in d:
            return resolve(d)
        known = {f.name for f in fields(cls)} - {"source"}
        return cls(**{k: v for k, v in d.items() if k in known})

    def hf_config(self, dtype: torch.dtype) -> dict:
        """The config.json a checkpoint of this architecture is saved with: the one it was read
        from (with the dtype saved), or transformers' Llama config for specdec's own models."""
        dtype_name = str(dtype).removeprefix("torch.")
        if self.source is not None:
            return {**{k: v for k, v in self.source.items() if k != "torch_dtype"}, "dtype": dtype_name}
        plain = Arch()
        if any(getattr(self, k) != getattr(plain, k) for k in FEATURES):
            raise SpecdecError(f"an architecture of family {self.family} built without its config.json cannot be "
                               "saved as a transformers checkpoint; load it from its folder instead")
        d = {k: v for k, v in self.to_dict().items() if k in LLAMA_KEYS}
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                 rope_theta=self.rope_theta, dtype=dtype_name, use_cache=True)
        return d


FEATURES = ("family", "rope_scaling", "partial_rotary_factor", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
            "norm_offset", "scale_embeddings", "activation", "fused_checkpoint", "sliding_window", "local_layers",
            "local_rope_theta", "sandwich_norms", "query_pre_attn_scalar", "final_logit_softcapping")
LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
              "bos_token_id", "eos_token_id")


def _yarn_inv_freq(rope: dict, dim: int, base: float, max_position: int) -> torch.Tensor:
    factor = rope.get("factor") or max_position / rope["original_max_position_embeddings"]
    original = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def refuse(path_hint: str, key: str, value, why: str):
    raise SpecdecError(f"{path_hint}: config key {key!r} = {value!r} is refused: {why}")


def resolve(d: dict, where: str = "config.json") -> Arch:
    """The Arch of a transformers config.json dict, or SpecdecError naming the key it cannot run."""
    family = d.get("model_type")
    if family in REFUSED_FAMILIES:
        raise SpecdecError(f"{where}: model_type {family!r} is refused: {REFUSED_FAMILIES[family]} "
                           f"(supported: {', '.join(FAMILIES)})")
    if family not in FAMILIES:
        raise SpecdecError(f"{where}: model_type {family!r} is not supported; specdec runs {', '.join(FAMILIES)} "
                           "(use a transformers model through the adapter for other architectures)")
    for key, (plain, why) in UNREAD_AS.items():
        if key in d and d[key] != plain:
            refuse(where, key, d[key], why)
    for key in sorted(set(d) - INERT - UNREAD - set(UNREAD_AS) - READ - (GEMMA3_READ if family == "gemma3_text"
                                                                       else set())):
        refuse(where, key, d[key], f"specdec's {family} architecture does not implement it, and running without "
                                   "it would compute a different model")
    try:
        C, H = int(d["hidden_size"]), int(d["num_attention_heads"])
        sizes = dict(vocab_size=int(d["vocab_size"]), hidden_size=C, intermediate_size=int(d["intermediate_size"]),
                     num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=H,
                     num_key_value_heads=int(d.get("num_key_value_heads") or H),
                     head_dim=int(d.get("head_dim") or C // H), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)))
        max_position = int(d["max_position_embeddings"])
    except KeyError as e:
        raise SpecdecError(f"{where} has no {e.args[0]!r}: it is not a complete {family} config") from None
    if d.get("pretraining_tp", 1) != 1:
        refuse(where, "pretraining_tp", d["pretraining_tp"], "sliced matmuls summed in another order; specdec "
                                                             "computes tp = 1")
    if d.get("use_bidirectional_attention"):
        refuse(where, "use_bidirectional_attention", True, "specdec decodes causally")
    activation = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if family in ("gemma", "gemma3_text") and activation == "gelu":  # Gemma's legacy "gelu": the tanh form
        activation = "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        refuse(where, "hidden_act", activation, f"specdec's activations are {', '.join(sorted(ACTIVATIONS))}")
    gemma3 = gemma3_settings(d, where, sizes["num_hidden_layers"]) if family == "gemma3_text" else {}
    theta, scaling, partial = rope_settings(gemma3.pop("global_rope", d), where, family)
    window = gemma3.pop("window") if gemma3 else sliding_window(d, family, sizes["num_hidden_layers"])
    context = max_position if window is None or gemma3.get("local_layers") else min(max_position, window)
    if scaling.get("rope_type") == "longrope":
        scaling = longrope(scaling, max_position, int(sizes["head_dim"] * partial) // 2, where)
        context = min(context, scaling["original_max_position_embeddings"])
    attention_bias = bool(d.get("attention_bias", False))
    gemma = family in ("gemma", "gemma3_text")
    eos = d.get("eos_token_id")
    arch = Arch(**sizes, max_position_embeddings=context, rope_theta=theta,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
                bos_token_id=d.get("bos_token_id"), eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else eos,
                family=family, rope_scaling=scaling, partial_rotary_factor=partial,
                qkv_bias=family == "qwen2" or (attention_bias and (family in ("llama", "qwen3") or gemma)),
                o_bias=attention_bias and (family in ("llama", "qwen3") or gemma),
                mlp_bias=bool(d.get("mlp_bias", False)) and family == "llama",
                qk_norm=family in ("qwen3", "gemma3_text"), norm_offset=1.0 if gemma else 0.0,
                scale_embeddings=gemma, activation=ACTIVATIONS[activation],
                fused_checkpoint=family == "phi3", sliding_window=window, source=dict(d), **gemma3)
    if attention_bias and family not in ("llama", "qwen3", "gemma", "gemma3_text", "qwen2"):
        refuse(where, "attention_bias", True, f"transformers' {family} has no attention biases")
    if d.get("mlp_bias") and family != "llama":
        refuse(where, "mlp_bias", True, f"transformers' {family} has no MLP biases")
    return arch


def rope_settings(d: dict, where: str, family: str) -> tuple[float, dict, float]:
    """(theta, the scaling's parameters or {}, the partial rotary factor) from either layout:
    transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    rope = dict(d.get("rope_parameters") or {})
    if d.get("rope_scaling"):
        rope = {**rope, **d["rope_scaling"]}
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if family == "phi3" and kind in ("su", "yarn"):  # transformers reads Phi-3's older names as longrope
        kind = "longrope"
    if kind not in ROPE_TYPES:
        refuse(where, "rope_scaling", {"rope_type": kind, **rope},
               f"specdec implements the rope types {', '.join(ROPE_TYPES)}")
    if kind == "longrope":
        if rope.get("original_max_position_embeddings") is None and d.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    if kind == "default":
        return theta, {}, partial
    if kind == "dynamic":
        # transformers' dynamic NTK keeps the default frequencies for sequences within
        # max_position_embeddings, the longest specdec runs: exactly default RoPE here
        return theta, {}, partial
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"),
              "yarn": ("original_max_position_embeddings",),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}[kind]
    allowed = set(needed) | {"factor"} | ({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                          "truncate"} if kind == "yarn" else set()) | (
        {"attention_factor"} if kind == "longrope" else set())
    for key in needed:
        if rope.get(key) is None:
            refuse(where, "rope_scaling", {"rope_type": kind, **rope}, f"{kind} scaling needs {key!r}")
    for key in sorted(set(rope) - allowed):
        refuse(where, f"rope_scaling.{key}", rope[key], f"{kind} scaling in specdec does not implement it")
    return theta, {"rope_type": kind, **rope}, partial


def longrope(rope: dict, max_position: int, half: int, where: str) -> dict:
    """Phi-3's longrope, honoured within original_max_position_embeddings, where transformers uses
    the short factors (the long ones only beyond it, which specdec refuses to run: the context is
    cut there); its attention factor comes from the config's full max_position_embeddings."""
    if len(rope["short_factor"]) != half:
        refuse(where, "rope_scaling.short_factor", f"{len(rope['short_factor'])} values",
               f"longrope needs one per rotated frequency ({half})")
    return {**rope, "factor": rope.get("factor") or max_position / rope["original_max_position_embeddings"]}


def sliding_window(d: dict, family: str, layers: int) -> int | None:
    """The window of the layers that slide, None if none does. Sliding layers are honoured by
    running no context longer than the window, where a window masks nothing."""
    window = d.get("sliding_window")
    if window is None:
        return None
    if family in ("qwen2", "qwen3"):
        types = d.get("layer_types")
        if types is None:
            slides = d.get("use_sliding_window", False) and d.get("max_window_layers", layers) < layers
        else:
            slides = "sliding_attention" in types
        return int(window) if slides else None
    return int(window)


def gemma3_settings(d: dict, where: str, layers: int) -> dict:
    """Gemma 3's layer as transformers' Gemma3TextConfig reads it: which layers are local (layer_types,
    else every sliding_window_pattern-th layer global, 6 by default), the window, the local layers'
    rotary base (rope_parameters' sliding_attention, else rope_local_base_freq, else 10000) and the
    global layers' rotary settings (full_attention's, else rope_theta, 1e6 by default, and rope_scaling),
    the query scale and the final logits' soft cap. Attention scores soft-capped are refused by name."""
    if d.get("attn_logit_softcapping") is not None:
        refuse(where, "attn_logit_softcapping", d["attn_logit_softcapping"],
               "specdec's attention does not soft-cap its scores (no released Gemma 3 does)")
    rope = d.get("rope_parameters") or {}
    nested = "full_attention" in rope or "sliding_attention" in rope
    full = dict(rope.get("full_attention") or {}) if nested else {**rope, **(d.get("rope_scaling") or {})}
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    local = dict(rope.get("sliding_attention") or {}) if nested else {}
    local_theta = float(local.pop("rope_theta", d.get("rope_local_base_freq", 10_000.0)))
    if local.pop("rope_type", "default") != "default" or local:
        refuse(where, "rope_parameters.sliding_attention", rope.get("sliding_attention"),
               "specdec's local Gemma 3 layers rotate with a default rotary embedding")
    types = d.get("layer_types")
    if types is None:
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        refuse(where, "layer_types", types, f"one of sliding_attention or full_attention per layer ({layers})")
    window = d.get("sliding_window")
    local_layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention") if window else ()
    scalar = d.get("query_pre_attn_scalar", 256)
    cap = d.get("final_logit_softcapping")
    return {"global_rope": {"rope_parameters": full}, "window": int(window) if window else None,
            "local_layers": local_layers, "local_rope_theta": local_theta if local_layers else None,
            "sandwich_norms": True, "query_pre_attn_scalar": float(scalar) if scalar is not None else None,
            "final_logit_softcapping": float(cap) if cap is not None else None}
