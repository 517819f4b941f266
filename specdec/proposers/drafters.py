"""The drafter registry: the one place a proposer is made. A name maps to an entry that knows its
proposer class (the protocol in decoding/protocol.py), its shipped folders under models/ (one per
target it was trained for; the default for a target is the one that fits it; none: a lookup
method, which reads no folder), whether a folder fits a target (`misfit`: from the folder's
metadata and tokenizer, before any weight is read; None when it fits, else the reason in one line),
how to read its network for a target (in the target's dtype, on its device) and how to make a
proposer of it with the options a caller gives: each drafter's own small dataclass (`options`:
`VocabOptions`, `DraftModelOptions`, `NgramOptions`, `NoOptions`), refused when it is another's. The
command line (generate, serve, check, bench), the API and the benchmark all call `build_drafter`;
from networks already in hand, the proposer's class makes one (typed by its own signature).

A target is a loaded checkpoint: anything with `model` (a causal LM), `admitted` (it admitted:
lm/interface.Admitted, its device, dtype and abilities), `path` (its checkpoint folder) and
`tokenizer` (api.Loaded).

Dispatch happens once, here; the engine only ever calls the protocol's methods. This module knows
nothing about the command line, benchmarks or serving.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from ..decoding.protocol import Proposer
from ..errors import SpecdecError
from ..heads.block import BLOCK_FOLDER
from ..heads.eagle import EAGLE_FOLDER
from ..heads.folder import check_head_target, load_head
from ..heads.mtp import MTP_FOLDER
from ..kernels import storing_error
from ..kernels.blocks import QUANTIZED, blocking_error
from ..lm import gguf, local_counts, packaged
from ..lm.arch import resolve
from ..lm.checkpoint import (META, PARALLEL_KIND, build_model, load_model, load_token_counts, read_config,
                             read_meta)
from ..lm.device import release_freed_memory
from ..lm.gguf_blocks import load_as_stored
from ..lm.model import Linear, LlamaForCausalLM, requantize, store_matrices, stored_formats
from ..lm.tokenizer import Tokenizer
from .block import BlockProposer
from .draft_model import DraftModelProposer, chosen_vocab
from .eagle import EagleProposer
from .hybrid import SURE_MATCH, HybridProposer
from .mtp import MTPProposer
from .guided_ngram import GuidedNgramProposer
from .parallel import ParallelDraftProposer
from .self_draft import FORMAT as SELF_FORMAT
from .self_draft import HEAD_FORMAT as SELF_HEAD_FORMAT
from .self_draft import SelfDraftProposer
from .suffix import SuffixProposer

MODELS = Path(__file__).resolve().parents[2] / "models"  # the shipped models of a full clone


@dataclass(frozen=True)
class NoOptions:
    """A drafter that takes no options (suffix lookup)."""


@dataclass(frozen=True)
class VocabOptions:
    """A drafter with a network that can draft over part of its vocabulary (heads, a parallel draft)."""
    draft_vocab: int | None = None  # draft over the N token ids most frequent in the drafter's training tokens
    counted_only: bool = False      # ... only where the drafter saved those counts (else its whole vocabulary)

    def __post_init__(self):
        model = isinstance(self, DraftModelOptions)  # a draft model's may be "auto" (chosen_vocab) or "full"
        if not (self.draft_vocab is None or (model and self.draft_vocab in ("auto", "full"))
                or (type(self.draft_vocab) is int and self.draft_vocab > 0)):
            raise SpecdecError(f"draft_vocab is a number of token ids >= 1{', auto or full' if model else ''}, got "
                               f"{self.draft_vocab!r}" + (f" ({self.draft_vocab} is a draft model's)"
                                                          if self.draft_vocab in ("auto", "full") else ""))


@dataclass(frozen=True)
class TreeOptions(VocabOptions):
    """A draft model's network that also grows its trees by its confidence (the self-draft)."""
    dynamic_tree: bool = False      # grow trees by the draft's confidence (EAGLE-2)


@dataclass(frozen=True)
class DraftModelOptions(TreeOptions):
    """A draft model of its own. Its draft_vocab may also be "auto": the size the cost model
    favours (draft_model.chosen_vocab), or "full"; None: auto for a GGUF draft (its counts made here
    from local text, once), the full vocabulary for a checkpoint folder's (trained: its own counts are
    there to ask for). draft_quantize: its matrices that read more bytes a weight
    than this quantized format would stored in it at load (lm/model.requantize): a draft's forward at
    batch 1 costs the bytes it reads, and what the draft proposes the target verifies. "auto": Q4_0
    for a GGUF draft run as stored (already quantized by its maker: its 5- to 8-bit matrices, a Q4_K_M
    file's Q5_0, Q8_0 and Q6_K, to 4 bits), a checkpoint folder's weights as they are."""
    draft_vocab: int | str | None = None
    stop_below: float | None = None  # end a chain after a draft whose top probability is below this
    draft_quantize: str | None = "auto"  # "q4_0", "q4_1", "q8_0", "auto" or None (as stored)

    def __post_init__(self):
        super().__post_init__()
        if self.draft_quantize not in (None, "auto", *QUANTIZED):
            raise SpecdecError(f"draft_quantize is one of {', '.join(QUANTIZED)}, auto or None (as stored), got "
                               f"{self.draft_quantize!r}")


@dataclass(frozen=True)
class NgramOptions:
    ngram_max: int | None = None    # the longest n-gram matched (None: the proposer's default)
    ngram_min: int | None = None    # the shortest


@dataclass
class DraftCheckpoint:
    """A draft model read for a target: its weights and what was saved beside them."""
    model: object                 # specdec's LlamaForCausalLM
    path: Path
    token_counts: object = None   # (V,) of its training tokens, where saved
    meta: dict | None = None      # its specdec.json
    gguf: bool = False            # a GGUF file (path): its counts are made here when asked, kept in specdec's cache


class Drafter:
    """An entry of the registry; the subclasses below fill in what differs."""
    name: str
    cls: type                   # its proposer
    shipped: tuple[str, ...] = ()  # its folders under models/, one per target it was trained for (none: it reads no folder)
    what: str = ""              # how messages name it
    train: str = ""             # how to make one that fits
    reads: str | None = None    # what its folder holds, "draft_model" or "heads" (None: it reads no folder)
    options: type = NoOptions     # the dataclass of its options

    def folder(self, path=None, target=None) -> Path | None:
        """The folder read: `path` (a packaged model's short name: its file, lm/packaged.py), else the
        shipped one trained for `target` (the first shipped one where none fits, so that loading it says
        why), None for a lookup method."""
        if not self.shipped:
            return None
        if path is not None:
            return Path(packaged.resolve(path))
        shipped = [MODELS / name for name in self.shipped]
        fitting = [f for f in shipped if target is not None and self.misfit_at(target, f) is None]
        return (fitting or shipped)[0]

    def misfit(self, target, path=None) -> str | None:
        """None when the drafter at `path` (default: the shipped one for `target`) fits `target`, else why not."""
        return self.misfit_at(target, self.folder(path, target))

    def misfit_at(self, target, folder: Path | None) -> str | None:
        try:
            self.check(target, folder)
        except SpecdecError as e:
            return str(e)
        return None

    def check(self, target, folder: Path | None) -> None:
        """Refuse, with what to do, a drafter in `folder` that does not fit `target` (here: the
        shipped one missing; each kind checks its folder's contents)."""
        if folder is not None and folder.parent == MODELS and folder.name in self.shipped and not folder.exists():
            raise SpecdecError(f"the shipped {self.what} is missing at {folder}: run from a full clone of specdec "
                               f"or pass a folder ({self.train})")

    def network(self, target, folder: Path | None):
        """What the proposer drafts with, read from `folder` for `target` (None: nothing to read)."""
        self.check(target, folder)
        return None

    def proposer(self, network, target, options) -> Proposer:
        """Its proposer of `network` for `target` with `options` (of its `options` type)."""
        raise NotImplementedError

    def describe(self, network, proposer: Proposer, options) -> dict:
        """What a report says about the drafter: its settings and its network's size and shape."""
        return {}

    @property
    def learned(self) -> bool:
        """Whether it drafts alone with a network trained for its target (bench reports set such
        drafters side by side with what each cost to train)."""
        return bool(self.shipped) and self.cls is not HybridProposer

    def condition(self, info: dict) -> str | None:
        """How a report's conditions name the network a run read (`describe`'s figures with its `path`,
        bench/runner.py); None where it reads none."""
        return f"{self.what} `{info['path']}`" if "path" in info else None

    def load(self, target, path=None, options=None) -> Proposer:
        return self.proposer(self.network(target, self.folder(path, target)), target, self.checked(options))

    def checked(self, options):
        """`options` (None: the defaults) as this drafter takes them: of its own `options` type."""
        if options is None:
            return self.options()
        if type(options) is not self.options:
            raise SpecdecError(f"the {self.name} drafter takes {self.options.__name__}, not {type(options).__name__}")
        return options


def draft_vocab(options: VocabOptions, token_counts) -> int | None:
    """The draft vocabulary asked for; None where it is asked only of drafters that saved their
    token counts and there are none."""
    return None if options.counted_only and token_counts is None else options.draft_vocab


AUTO_DRAFT_FORMAT = "q4_0"  # a GGUF draft's format by default (docs/quantized.md, "A draft in four bits")


class DraftModel(Drafter):
    name, cls, shipped, what = "draft-model", DraftModelProposer, ("draft",), "draft model"
    reads, options = "draft_model", DraftModelOptions
    train = "train one with `specdec train --preset draft` (it must share the target's tokenizer)"

    def check(self, target, folder) -> None:
        super().check(target, folder)
        if gguf.is_gguf(folder):  # its tokenizer from its metadata, in memory
            tokenizer = gguf.tokenizer(folder)
        else:
            read_config(folder)  # a checkpoint folder (not a heads folder, not nothing)
            tokenizer = Tokenizer.load(folder)
        self.check_tokenizer(target, folder, tokenizer)

    def check_tokenizer(self, target, folder, tokenizer: Tokenizer) -> None:
        if tokenizer.tok.get_vocab() != target.tokenizer.tok.get_vocab():
            source = ("the tokenizer.json of its converted folder, api.checkpoint_folder" if gguf.is_gguf(target.path)
                      else f"{target.path}/tokenizer.json")
            raise SpecdecError(f"the draft model {folder} uses another tokenizer than the target {target.path}; "
                               f"a draft must share the target's tokenizer (train it with --tokenizer: {source})")

    def network(self, target, folder) -> DraftCheckpoint:
        """The draft in the target's dtype and device; a .gguf draft runs its file's blocks as stored
        (gguf_blocks) where the target computes in float32 on the CPU, else its conversion (in memory)
        in the target's dtype: a target whose matrices are bf16 (a .gguf's `--quantize bf16`), its
        draft's values in bf16 too."""
        self.check(target, folder)
        if not gguf.is_gguf(folder):
            model = load_model(folder, dtype=target.admitted.dtype, device=target.admitted.device)
            return DraftCheckpoint(model, folder, load_token_counts(folder), read_meta(folder))
        quantized = any(isinstance(m, Linear) and m.stored is not None and m.weight is None
                        for m in target.model.modules())
        if quantized and target.admitted.dtype == torch.float32 and torch.device(target.admitted.device).type == "cpu":
            model = load_as_stored(folder)
        else:
            config, state = gguf.converted(folder)
            model = build_model(resolve(config, where=folder.name), state, target.admitted.dtype,
                                target.admitted.device, path=folder)
        return DraftCheckpoint(model, folder, None, {}, gguf=True)

    def proposer(self, draft: DraftCheckpoint, target, options) -> Proposer:
        if options.draft_vocab is None:  # a GGUF draft over the cost model's vocabulary by default
            options = replace(options, draft_vocab="auto" if draft.gguf else "full")
        if draft.gguf and options.draft_vocab != "full":  # a GGUF holds no counts: made here (once, cached)
            draft.token_counts = local_counts.counted_once(gguf.entry(draft.path), target.tokenizer.tok,
                                                           draft.model.config.vocab_size)
        quantize = options.draft_quantize
        if quantize == "auto":  # a GGUF draft's blocks as stored (the kernels' CPU float32), in Q4_0
            quantize = AUTO_DRAFT_FORMAT if draft.gguf and not any(
                isinstance(m, Linear) and m.weight is not None for m in draft.model.modules()) else None
        if quantize is not None:
            requantize(draft.model, quantize)
            release_freed_memory()  # the matrices it replaced
        size = draft_vocab(options, draft.token_counts)
        if size == "auto":  # without counts the one size to choose is the whole vocabulary
            size = None if draft.token_counts is None else chosen_vocab(draft.model, target.model, draft.token_counts)
        if size == "full":
            size = None
        return DraftModelProposer(draft.model, size, draft.token_counts,
                                  tree="dynamic" if options.dynamic_tree else "static", stop_below=options.stop_below)

    def describe(self, draft, proposer, options) -> dict:
        return {"draft_vocab": "full" if proposer.draft_ids is None else len(proposer.draft_ids),
                "weights": stored_formats(draft.model)}

    def condition(self, info: dict) -> str | None:
        draft = info.get("draft")
        return draft and f"{self.what} `{draft['path']}` ({draft['parameters'] / 1e6:.1f}M, {draft['dtype']})"


class ParallelDraft(DraftModel):
    name, cls, shipped, what = "parallel", ParallelDraftProposer, ("parallel-draft",), "parallel draft"
    options = VocabOptions
    train = "train one with `specdec train --objective parallel --init-from DRAFT --teacher TARGET`"

    def check(self, target, folder) -> None:
        """Its metadata names a mask token, its block and the hash of the target it was trained for."""
        Drafter.check(self, target, folder)
        read_config(folder)
        info = read_meta(folder)
        parallel = info.get("parallel") if info.get("kind") == PARALLEL_KIND else None
        if not isinstance(parallel, dict) or not {"mask_token_id", "block", "target_sha256"} <= parallel.keys():
            raise SpecdecError(f"{folder} is not a parallel draft (its {META} names no mask token, block and "
                               "target): a plain draft model drafts with --draft draft-model; " + self.train)
        if parallel["target_sha256"] != gguf.weights_sha256(target.path):
            raise SpecdecError(f"the parallel draft {folder} was trained for another target (model.safetensors "
                               f"sha256 {parallel['target_sha256'][:12]}..., not {target.path}'s): train one for "
                               "this target")
        self.check_tokenizer(target, folder, Tokenizer.load(folder))

    def proposer(self, draft: DraftCheckpoint, target, options) -> Proposer:
        parallel = draft.meta["parallel"]
        return ParallelDraftProposer(draft.model, parallel["mask_token_id"], parallel["block"],
                                     draft_vocab(options, draft.token_counts), draft.token_counts)

    def describe(self, draft, proposer, options) -> dict:
        return {"draft_vocab": draft_vocab(options, draft.token_counts) or "full", "block": proposer.max_depth,
                "native_step": proposer.native}


class Ngram(Drafter):
    """N-gram lookup; under structured output it walks through the grammar (guided_ngram.py)."""
    name, cls, what = "ngram", GuidedNgramProposer, "n-gram lookup"
    options = NgramOptions

    def proposer(self, network, target, options) -> Proposer:
        sizes = {"max_n": options.ngram_max, "min_n": options.ngram_min}
        return self.cls(**{name: n for name, n in sizes.items() if n is not None})

    def describe(self, network, proposer, options) -> dict:
        return {"max_n": proposer.max_n, "min_n": proposer.min_n}


class Suffix(Drafter):
    name, cls, what = "suffix", SuffixProposer, "suffix-tree lookup"

    def proposer(self, network, target, options) -> Proposer:
        return SuffixProposer()


class SelfDraft(Drafter):
    """The target's own weights, quantized, as its draft model: no folder, fits specdec's own target
    whose matrices cut into the quantized formats' blocks."""
    name, cls, what = "self", SelfDraftProposer, "self-draft"
    options = TreeOptions

    def check(self, target, folder) -> None:
        """specdec's own model, every matrix's rows (hidden size, attention output, intermediate
        size) a whole number of quantization blocks: said from the config, before a weight is read."""
        super().check(target, folder)
        if not isinstance(target.model, LlamaForCausalLM):
            raise SpecdecError(f"the self-draft quantizes specdec's own target, not {type(target.model).__name__}: "
                               "load the checkpoint with specdec (api.load), or use another drafter")
        cfg = target.model.config
        for what, K in (("hidden size", cfg.hidden_size), ("attention width", cfg.num_attention_heads * cfg.head_dim),
                        ("intermediate size", cfg.intermediate_size)):
            for format in (SELF_FORMAT, SELF_HEAD_FORMAT):
                why = blocking_error(format, K)
                if why is not None:
                    raise SpecdecError(f"the self-draft quantizes the target's matrices ({why}: its {what}); "
                                       "this target needs another drafter")

    def proposer(self, network, target, options) -> Proposer:
        return SelfDraftProposer(target.model, draft_vocab=draft_vocab(options, target.token_counts),
                                 token_counts=target.token_counts,
                                 tree="dynamic" if options.dynamic_tree else "static")


class Head(Drafter):
    """A head trained on one target's features: its folder names that target's hash."""
    reads, options = "heads", VocabOptions
    kind = MTP_FOLDER  # its folder's kind, read by the one head loader (heads/folder.py)

    def check(self, target, folder) -> None:
        super().check(target, folder)
        if not target.admitted.abilities.layers:
            raise SpecdecError(f"the {self.what} draft from specdec's own LlamaForCausalLM target, not "
                               f"{type(target.model).__name__}")
        check_head_target(self.kind, folder, target.path)  # a .gguf's: trained for its conversion's weights

    def network(self, target, folder):
        Drafter.check(self, target, folder)  # the loader checks the rest
        return load_head(self.kind, folder, target.path, dtype=target.admitted.dtype, device=target.admitted.device)

    def proposer(self, head, target, options) -> Proposer:
        return self.cls(head, target.model, draft_vocab(options, head.token_counts))

    def describe(self, head, proposer, options) -> dict:
        """Its kind, draft vocabulary and size (matrices held as blocks counted too) and their formats."""
        blocks = sum(m.in_features * m.out_features for m in head.modules()
                     if isinstance(m, Linear) and m.weight is None)
        return {"head_kind": head.kind, "draft_vocab": draft_vocab(options, head.token_counts) or "full",
                "parameters": sum(p.numel() for p in head.parameters()) + blocks, "matrices": stored_formats(head)}

    def condition(self, info: dict) -> str | None:
        return f"{self.what} `{info['path']}` ({info['head_kind']}, {self.shape(info)}{info['parameters'] / 1e6:.1f}M)"

    def shape(self, info: dict) -> str:
        """Its shape as the conditions say it, before its size ("": nothing to say)."""
        return ""


class MTP(Head):
    name, cls, shipped, what = "mtp", MTPProposer, ("target-mtp",), "MTP heads"
    train = "train heads with `specdec train --objective mtp-sequential --frozen-trunk TARGET`"

    def describe(self, heads, proposer, options) -> dict:
        return {**super().describe(heads, proposer, options), "depth": heads.depth}

    def shape(self, info: dict) -> str:
        return f"{info['depth']} modules, "


class Eagle(Head):
    name, cls, shipped, what = "eagle", EagleProposer, ("eagle", "smollm2-eagle3"), "EAGLE head"
    train = "train one with `specdec train --objective eagle --target TARGET`"
    kind = EAGLE_FOLDER
    matrices = "q8_0"  # where the kernels run its bf16 matrices, it drafts from them in Q8_0: a cheaper draft
    # step for the same acceptance (measured: docs/methods/eagle.md)

    def network(self, target, folder):
        """The head, its matrices in `matrices` where they are bf16 for the kernels and cut into its blocks."""
        head = super().network(target, folder)
        linears = [m for m in head.modules() if isinstance(m, Linear)]
        if all(m.stored is not None and m.stored.format == "bf16" and storing_error(m.weight, self.matrices) is None
               for m in linears):
            store_matrices(head, self.matrices)
        return head

    def describe(self, head, proposer, options) -> dict:
        """Its own draft vocabulary, or the smaller one it drafts over."""
        return {**super().describe(head, proposer, options), "layer_ids": list(head.layer_ids),
                "draft_vocab": min(draft_vocab(options, head.token_counts) or head.draft_vocab_size,
                                   head.draft_vocab_size)}

    def shape(self, info: dict) -> str:
        return (f"target layers {' '.join(map(str, info['layer_ids']))}, {info['draft_vocab']}-token draft vocabulary, "
                f"{info['matrices']} matrices, ")


class Block(Head):
    name, cls, shipped, what = "block", BlockProposer, ("block-head",), "block head"
    train = "train one with `specdec train --objective block --target TARGET`"
    kind = BLOCK_FOLDER

    def describe(self, head, proposer, options) -> dict:
        """It drafts over its own draft vocabulary."""
        return {**super().describe(head, proposer, options), "layer_ids": list(head.layer_ids), "block": head.block,
                "attention": head.attention, "draft_vocab": head.draft_vocab_size}

    def shape(self, info: dict) -> str:
        return f"target layers {' '.join(map(str, info['layer_ids']))}, blocks of {info['block']}, "


class BehindLookup(Drafter):
    """A model drafter behind suffix-tree lookup (hybrid.py): lookup drafts where the row's text ends
    in a match of `sure_match` tokens or more, the model elsewhere, at most `model_depth` levels
    (None: as many as the step allows). The model drafter's folder, options and checks."""
    cls = HybridProposer

    def __init__(self, name: str, model: Drafter, sure_match: int = SURE_MATCH, model_depth: int | None = None):
        self.name, self.model, self.sure_match, self.model_depth = name, model, sure_match, model_depth
        self.what = f"{model.what} behind suffix lookup"
        self.shipped, self.train, self.reads, self.options = model.shipped, model.train, model.reads, model.options

    def check(self, target, folder) -> None:
        self.model.check(target, folder)

    def network(self, target, folder):
        return self.model.network(target, folder)

    def condition(self, info: dict) -> str | None:
        return self.model.condition(info)

    def proposer(self, network, target, options) -> Proposer:
        return HybridProposer(SuffixProposer(min_match=self.sure_match), self.model.proposer(network, target, options),
                              self.model_depth, self.name)

    def describe(self, network, proposer, options) -> dict:
        return {**self.model.describe(network, proposer.model, options),
                "lookup": f"suffix, where it matches {self.sure_match} tokens or more",
                "model_depth": self.model_depth or "the step's"}


# the EAGLE head behind lookup from 3 tokens on, drafting at most 2 levels: the best of the settings measured
# on SmolLM2's head (docs/methods/eagle.md, "Behind suffix lookup")
EAGLE_SURE_MATCH, EAGLE_DEPTH = 3, 2

DRAFTERS: dict[str, Drafter] = {d.name: d for d in (DraftModel(), ParallelDraft(), Ngram(), MTP(), Suffix(),
                                                    Eagle(), Block(), SelfDraft(), BehindLookup("hybrid", DraftModel()),
                                                    BehindLookup("eagle-hybrid", Eagle(), EAGLE_SURE_MATCH,
                                                                 EAGLE_DEPTH))}


def option_owners() -> dict[str, tuple[str, ...]]:
    """Each option a drafter takes, by name (the folder it `reads` and its options' fields), and the
    drafters that take it (k and tree: every one)."""
    owners = {"k": tuple(DRAFTERS), "tree": tuple(DRAFTERS)}
    for d in DRAFTERS.values():
        for option in ([d.reads] if d.reads else []) + [f.name for f in fields(d.options)]:
            owners[option] = owners.get(option, ()) + (d.name,)
    return owners


def drafter(name: str) -> Drafter:
    if name not in DRAFTERS:
        raise SpecdecError(f"unknown proposer {name!r}; known: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[name]


def build_drafter(name: str, target, path=None, options=None) -> Proposer:
    """The proposer `name` for `target` (api.Loaded), its network read from `path` (default: the
    shipped one), with `options` of the drafter's own type (None: its defaults); refused with the
    reason and what to do where it does not fit."""
    return drafter(name).load(target, path, options)

