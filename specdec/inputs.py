"""The one validation layer for what a user hands specdec, shared by the `specdec` command and the
Python API: prompts, sampling settings, k, draft options, and the arguments of `simulate`, `serve`
and `bench`. Every check runs before any model is loaded or any output is written, and a bad value
raises SpecdecError naming the value and what to give instead, never a traceback.

This module knows nothing about models, tokens or timing.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

from .decoding.sampling import SamplingConfig
from .errors import SpecdecError
from .proposers.drafters import DRAFTERS, DraftModelOptions, option_owners

MAX_SEED = 2 ** 63 - 1


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def shown(value) -> str:
    """A value for an error message: its repr, cut short (a huge integer as its size)."""
    if _is_int(value) and abs(value) > 10 ** 40:
        return f"an integer of {int(value).bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(name: str, value, low: int | None = None, high: int | None = None, optional: bool = False):
    """`value` as an int in [low, high] (None allowed when `optional`)."""
    if value is None and optional:
        return None
    if not _is_int(value):
        raise SpecdecError(f"{name} must be an integer, got {shown(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}" if low is not None else f"<= {high}"
        raise SpecdecError(f"{name} must be {bounds}, got {shown(value)}")
    return int(value)


def number(name: str, value, low: float | None = None, high: float | None = None, low_open: bool = False,
           optional: bool = False):
    """`value` as a finite float in [low, high] ((low, high] when `low_open`)."""
    if value is None and optional:
        return None
    if not _is_real(value) or (_is_int(value) and abs(value) > 10 ** 300) or not math.isfinite(value):
        raise SpecdecError(f"{name} must be a finite number, got {shown(value)}")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        if high is None:
            bounds = f"{'>' if low_open else '>='} {low}"
        else:
            bounds = f"in {'(' if low_open else '['}{low}, {high}]"
        raise SpecdecError(f"{name} must be {bounds}, got {shown(value)}")
    return float(value)


def prompts(value) -> list[str]:
    """A prompt or a list of prompts: non-empty lists of non-empty text that is valid Unicode
    (a command-line argument with bytes that are not UTF-8 arrives with lone surrogates)."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, (bytes, bytearray)):
        raise SpecdecError("prompts must be text (str), not bytes: decode them first, e.g. data.decode('utf-8')")
    elif value is None or not isinstance(value, (list, tuple)):
        raise SpecdecError(f"prompts must be a string or a list of strings, got {type(value).__name__}")
    if not value:
        raise SpecdecError("no prompts given: pass a string or a non-empty list of strings")
    for i, p in enumerate(value):
        if not isinstance(p, str):
            raise SpecdecError(f"prompt {i} must be text (str), got {type(p).__name__}")
        if not p:
            raise SpecdecError(f"prompt {i} is empty; give some text to continue")
        text(f"prompt {i}", p)
    return list(value)


def text(name: str, value: str) -> str:
    """Text that is valid Unicode: no lone surrogates (a command-line argument with bytes that are
    not UTF-8 arrives with them; so does JSON's "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start:e.end]
        if all("\udc80" <= c <= "\udcff" for c in bad):  # undecodable bytes, escaped by Python
            shown = "bytes " + bad.encode("utf-8", "surrogateescape").hex(" ")
        else:
            shown = " ".join(f"U+{ord(c):04X}" for c in bad)
        raise SpecdecError(f"{name} is not valid UTF-8 text ({shown} at character {e.start}, a lone surrogate); "
                           "pass UTF-8 encoded text") from None
    return value


def sampling(temperature, top_k, top_p, seed) -> None:
    number("temperature", temperature, low=0)
    SamplingConfig(temperature)  # 0 (greedy) or large enough to divide logits by
    integer("top_k", top_k, low=1, optional=True)
    number("top_p", top_p, low=0, high=1, low_open=True, optional=True)
    integer("seed", seed, low=0, high=MAX_SEED, optional=True)


def generation(max_new_tokens, stop) -> tuple[str, ...]:
    integer("max_new_tokens", max_new_tokens, low=0)
    if isinstance(stop, str):
        raise SpecdecError(f"stop must be a list of strings, not one string: stop=[{stop!r}]")
    stop = tuple(stop or ())
    for s in stop:
        if not isinstance(s, str) or not s:
            raise SpecdecError(f"stop strings must be non-empty text, got {s!r}")
        text("a stop string", s)
    return stop


def draft_length(k, proposer, widths=None) -> None:
    """k counts the draft tokens per step, or is "auto": it needs a proposer to draft them (`proposer`:
    one, or the drafter's name before it is built; None: plain decoding). widths: a draft tree's most
    nodes per depth (one per level: len k)."""
    if widths is not None:
        if proposer is None:
            raise SpecdecError("a draft tree needs a proposer: pass a proposer (api.load_drafter) "
                               "(command line: --draft ...)")
        for w in widths:
            integer("a draft tree's width", w, low=1)
        if k not in (None, "auto") and k != len(widths):
            raise SpecdecError(f"a draft tree of {len(widths)} levels ({','.join(map(str, widths))}) drafts "
                               f"{len(widths)} levels per step, not k={k}: leave k out or set it to {len(widths)}")
    if k is None or k == "auto":
        if k == "auto" and proposer is None:
            raise SpecdecError('k="auto" chooses how much to draft: it needs a proposer (command line: --draft ...)')
        return
    integer("k (draft tokens per step)", k, low=0)
    if proposer is None and k > 0:
        raise SpecdecError(f"k={k} draft tokens per step needs a proposer: pass a proposer (api.load_drafter) "
                           f"(command line: --draft {'|'.join(DRAFTERS)}), or leave k out for plain decoding")


def draft_options(draft: str, given: dict[str, object]) -> None:
    """Command-line draft options: each belongs to the --draft choices the drafter registry says
    take it (drafters.option_owners: by the option's name, --draft-vocab's draft_vocab); `given` maps
    the flags set on the command line (e.g. "--heads") to their values."""
    owners = option_owners()
    for flag, value in given.items():
        takers = owners[flag.lstrip("-").replace("-", "_")]
        if value is not None and draft not in takers:
            raise SpecdecError(f"{flag} applies to --draft {' or '.join(takers)}, but --draft is {draft}: "
                               f"add --draft {takers[0]} or leave {flag} out")
    vocab = given.get("--draft-vocab")
    if vocab in ("auto", "full") and DRAFTERS[draft].options is not DraftModelOptions:
        what = "the cost model's size" if vocab == "auto" else "every token id"
        raise SpecdecError(f"--draft-vocab {vocab} ({what}) is a draft model's; give --draft {draft} a number of "
                           "token ids")
    integer("--draft-vocab", None if vocab in ("auto", "full") else vocab, low=1, optional=True)
    number("--stop-below (a probability)", given.get("--stop-below"), low=0, high=1, low_open=True, optional=True)
    lo = integer("--ngram-min", given.get("--ngram-min"), low=1, optional=True)
    hi = integer("--ngram-max", given.get("--ngram-max"), low=1, optional=True)
    if lo is not None and hi is not None and lo > hi:
        raise SpecdecError(f"--ngram-min {lo} is larger than --ngram-max {hi}")


def simulate(alpha, alpha_per_position, ks, draft_cost, batch_size, verify_ms, verify_tokens,
             moe_experts, moe_top_k, expert_fraction) -> None:
    if (alpha is None) == (alpha_per_position is None):
        raise SpecdecError("give exactly one of --alpha A (i.i.d. acceptance, with --ks) or "
                           "--alpha-per-position A1 A2 ... (measured α_i; k is their count)")
    number("--alpha (an acceptance rate)", alpha, low=0, high=1, optional=True)
    for a in alpha_per_position or ():
        number("--alpha-per-position values (acceptance rates)", a, low=0, high=1)
    if not ks:
        raise SpecdecError("--ks needs at least one draft length")
    for k in ks:
        integer("--ks values (draft lengths k)", k, low=1)
    number("--draft-cost", draft_cost, low=0)
    integer("--batch-size", batch_size, low=1)
    for ms in verify_ms or ():
        number("--verify-ms values", ms, low=0, low_open=True)
    if verify_tokens is not None:
        if verify_ms is None:
            raise SpecdecError("--verify-tokens names the points of --verify-ms: give both")
        for n in verify_tokens:
            integer("--verify-tokens values", n, low=1)
        if len(verify_tokens) != len(verify_ms):
            raise SpecdecError(f"--verify-tokens has {len(verify_tokens)} values but --verify-ms {len(verify_ms)}")
        if len(set(verify_tokens)) != len(verify_tokens):
            raise SpecdecError(f"--verify-tokens has repeated values: {verify_tokens}")
    if verify_ms is not None:
        tokens = verify_tokens or list(range(1, len(verify_ms) + 1))
        needed = batch_size * (1 + (len(alpha_per_position) if alpha_per_position else max(ks)))
        if 1 not in tokens or max(tokens) < needed:
            raise SpecdecError(f"the verify curve must include the 1-token point and reach {needed} tokens "
                               f"(batch {batch_size} x (k + 1)); it has {sorted(tokens)}")
    if moe_experts is not None:
        integer("--moe-experts", moe_experts, low=1)
        integer("--moe-top-k", moe_top_k, low=1, high=moe_experts)
        number("--expert-fraction", expert_fraction, low=0, high=1)


def serve(max_batch, max_queue, port, max_body_bytes, max_connections, shutdown_timeout, header_timeout,
          body_timeout, idle_timeout, prefix_cache=None, threads=None) -> None:
    """`specdec serve`'s limits (a shutdown timeout and the prefix cache may be 0; the others must be positive)."""
    integer("--threads", threads, low=1, optional=True)
    integer("--max-batch", max_batch, low=1)
    integer("--prefix-cache", prefix_cache, low=0, optional=True)
    integer("--max-queue", max_queue, low=0)
    integer("--port", port, low=1, high=65535)
    integer("--max-body-bytes", max_body_bytes, low=1024)
    integer("--max-connections", max_connections, low=1)
    number("--shutdown-timeout", shutdown_timeout, low=0)
    for flag, seconds in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout),
                          ("--idle-timeout", idle_timeout)):
        number(flag, seconds, low=0, low_open=True)


def bench(prompts, repeats, max_new_tokens, ks, temperatures, batch_sizes) -> None:
    """`specdec bench` overrides (None: the plan's value)."""
    integer("--prompts", prompts, low=1, optional=True)
    integer("--repeats", repeats, low=1, optional=True)
    integer("--max-new-tokens", max_new_tokens, low=1, optional=True)
    for k in ks or ():
        integer("--ks values (draft lengths k)", k, low=1)
    for t in temperatures or ():
        number("--temperatures values", t, low=0)
    for b in batch_sizes or ():
        integer("--batch-sizes values", b, low=1)
