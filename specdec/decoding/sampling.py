"""Sampling settings and the one logits -> probabilities transform, shared by target and draft.

Temperature 0 means greedy (argmax). Otherwise logits are divided by the temperature, then top-k
and top-p (nucleus) keep the most likely tokens, and the result is renormalised. Speculative
verification applies exactly this transform to target and draft logits before acceptance.

A sampled request with a seed is drawn by Gumbel-max instead of from a random stream: the token
at sequence position t is argmax(log target_probs + g), g Gumbel noise over the vocabulary fixed
by (seed, t) alone (`gumbel`, a counter-based hash, the same numbers on every device). That is an
exact draw from target_probs, and since nothing else is random the tokens depend only on the seed
and the target, never on the draft, k, the batch or the load (Daliri, Musco, Suresh 2024).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels
from ..errors import SpecdecError

MIN_TEMPERATURE = 1e-4  # the smallest temperature for which logits / temperature stays finite in float32


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise SpecdecError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, inf), got {self.temperature}: "
                               "below that, logits / temperature overflows float32 (use 0 for greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise SpecdecError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise SpecdecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: drawn by Gumbel-max with noise fixed by (seed, position)."""
        return self.seed is not None and not self.greedy

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A private generator on `device` (torch's global one is never touched): seeded, or from OS
        entropy. The same seed draws other numbers on another device."""
        g = torch.Generator(device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p.

    Greedy settings give the one-hot distribution of the argmax, so that a greedy draft and
    target are also valid inputs of rejection sampling.
    """
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.float().argmax(-1), logits.shape[-1]).float()
    probs = scaled(logits, cfg).softmax(-1)
    if cfg.top_p is not None and cfg.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep a token while the mass before it is below top_p (the first token always stays)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def scaled(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits of a sampled row -> float32 logits / temperature, -inf outside top-k: the log of
    `probabilities` before top-p, up to a constant per position."""
    logits = logits.float() if cfg.temperature == 1 else logits.float() / cfg.temperature  # x / 1 is x
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


class RowGenerators:
    """One random generator per batch row (None: torch's default), so that a request's draws
    depend only on its own seed, whatever else shares the batch. Accepted wherever a generator
    is (`uniform`, `sample`, the proposers and verify.rejection_sample)."""

    def __init__(self, generators: list[torch.Generator | None]):
        self.generators = generators

    def select(self, rows: list[int]) -> "RowGenerators":
        return RowGenerators([self.generators[b] for b in rows])


def of_rows(generator: torch.Generator | RowGenerators | None, rows: list[int]
            ) -> torch.Generator | RowGenerators | None:
    """The generator that draws for `rows` of a batch: their own (RowGenerators), else the shared one."""
    return generator.select(rows) if isinstance(generator, RowGenerators) else generator


def uniform(rows: int, cols: int, generator, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, cols) uniforms in [0, 1): from one generator, or row b from RowGenerators' b-th."""
    if isinstance(generator, RowGenerators):
        return torch.cat([torch.rand(1, cols, generator=g, dtype=dtype, device=device) for g in generator.generators])
    return torch.rand(rows, cols, generator=generator, dtype=dtype, device=device)


def rows_by_config(configs: list[SamplingConfig]) -> dict[SamplingConfig, list[int]]:
    """The rows of each distinct transform (temperature, top-k, top-p; the seed plays no part in
    it), usually one or a few even when every request brings its own seed."""
    groups: dict[SamplingConfig, list[int]] = {}
    for b, cfg in enumerate(configs):
        groups.setdefault(SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p), []).append(b)
    return groups


def by_config(transform, logits: torch.Tensor, configs: list[SamplingConfig]) -> torch.Tensor:
    """(B, ..., V) logits -> (B, ..., V) float32, row b by transform(its logits, configs[b]), applied
    once per distinct configuration."""
    groups = rows_by_config(configs)
    if len(groups) == 1:
        return transform(logits, configs[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for cfg, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = transform(logits[index], cfg)
    return out


def row_probabilities(logits: torch.Tensor, configs: list[SamplingConfig]) -> torch.Tensor:
    """(B, ..., V) logits -> (B, ..., V) probabilities, row b under configs[b] (`probabilities`)."""
    return by_config(probabilities, logits, configs)


def sample(probs: torch.Tensor, generator: torch.Generator | RowGenerators | None) -> torch.Tensor:
    """(B, V) probabilities (rows need not sum to 1) -> (B,) token ids, one draw per row.

    Inverse CDF: the first id whose cumulative mass exceeds u x the row's mass, u uniform in
    [0, 1), in float64 (so u x mass stays below the total and a zero-probability id is never
    drawn). Exact, and one uniform per row: torch.multinomial cost as much as a small target's
    forward on the CPU (docs/evidence/behind-the-code.md)."""
    cdf = probs.double().cumsum(-1)                                                      # (B, V)
    u = uniform(probs.shape[0], 1, generator, torch.float64, probs.device)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=probs.shape[-1] - 1).squeeze(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) index of the largest logit, the first one on ties (as torch.argmax).
    On the CPU through NumPy's vectorised scan: 3-4x quicker than torch's over a vocabulary.
    NumPy has no bfloat16: such logits are upcast first (exact, so the index is the same)."""
    if logits.device.type == "cpu" and not logits.requires_grad:
        exact = logits.float() if logits.dtype == torch.bfloat16 else logits
        return torch.from_numpy(exact.numpy().argmax(-1))
    return logits.argmax(-1)


def pick(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | RowGenerators | None,
         positions: list[int] | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens, every row under the same sampling settings (`pick_rows`)."""
    return pick_rows(logits, [cfg] * logits.shape[0], generator, positions)


def pick_rows(logits: torch.Tensor, configs: list[SamplingConfig], generator: torch.Generator | RowGenerators | None,
              positions: list[int] | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens, row b under configs[b]: greedy rows their argmax, seeded
    rows by Gumbel-max at positions[b] (the sequence position of the token chosen; without
    positions a seeded row is sampled from the generator), other rows one draw each from the
    generator (RowGenerators: row b's own)."""
    tokens = argmax(logits)                                                          # (B,)
    if all(cfg.greedy for cfg in configs):
        return tokens
    seeded = [b for b, cfg in enumerate(configs) if cfg.seeded and positions is not None]
    coupled = set(seeded)
    sampled = [b for b, cfg in enumerate(configs) if not cfg.greedy and b not in coupled]
    if seeded:
        s = torch.tensor(seeded, device=logits.device)
        noisy = perturbed(logits[s][:, None], [configs[b] for b in seeded], [[positions[b]] for b in seeded])
        tokens[s.to(tokens.device)] = argmax(noisy)[:, 0].to(tokens.device)
    if sampled:
        s = torch.tensor(sampled, device=logits.device)
        drawn = sample(row_probabilities(logits[s], [configs[b] for b in sampled]), of_rows(generator, sampled))
        tokens[s.to(tokens.device)] = drawn.to(tokens.device)
    return tokens


# ---- Gumbel-max with noise fixed by (seed, position) ----

def _splitmix64(x: np.ndarray) -> np.ndarray:
    """uint64 -> uint64, a bijection that mixes every bit (SplitMix64's finaliser; numpy wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix32(x: np.ndarray) -> np.ndarray:
    """uint32 -> uint32 in place, a bijection with good avalanche (Wellons' lowbias32)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def noise_keys(seeds: list[int], positions: list[list[int]]) -> np.ndarray:
    """(R,) seeds, (R, n) positions -> (R, n) uint64: one key per (seed, position)."""
    s = _splitmix64(np.array(seeds, dtype=np.uint64))[:, None]            # (R, 1)
    return _splitmix64(s ^ np.array(positions, dtype=np.uint64))           # (R, n)


def gumbel(seeds: list[int], positions: list[list[int]], vocab: int, ids: torch.Tensor | None = None,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """(R, n, V) float32 standard Gumbel noise on `device`, element (r, i, v) a function of
    (seeds[r], positions[r][i], v) only: two rounds of a 32-bit hash keyed by the (seed, position)
    key's halves, its top 23 bits as a uniform in the open interval (0, 1) (`open_uniform`), -log(-log(u)).
    ids (N,): the noise of those token ids only, (R, n, N) (a draft vocabulary's columns).
    On the CPU each (seed, position)'s row over the vocabulary is made once and kept a while (NOISE): a
    seeded row's drafts and its verification ask for the same positions, one after the other. On another
    device it is made there (`device_noise_rows`: the same numbers), where the logits are: a batched step
    of hundreds of seeded rows would otherwise hash on the host and copy 200 KB a row to the device."""
    length = vocab if ids is None or not len(ids) else int(ids.max()) + 1  # the row's columns needed
    keys = [(seed, t) for seed, row in zip(seeds, positions) for t in row]
    if torch.device(device).type != "cpu":
        noise = device_noise_rows(keys, length, torch.device(device))
        noise = noise[:, :vocab] if ids is None else noise[:, ids.to(noise.device)]
        return noise.reshape(len(seeds), -1, noise.shape[-1])
    if len(keys) > NoiseRows.KEYS:  # a batch this wide (a statistical test's): made at once, not kept
        made = noise_rows(keys, length) if keys else np.empty((0, length), np.float32)
    else:
        rows = NOISE.rows(keys, length)
        made = rows[0][None, :length] if len(rows) == 1 else np.array([row[:length] for row in rows])
    noise = torch.from_numpy(made)
    noise = noise[:, :vocab] if ids is None else noise[:, ids.cpu()]
    return noise.reshape(len(seeds), -1, noise.shape[-1])


def noise_rows(keys: list[tuple[int, int]], length: int) -> np.ndarray:
    """(len(keys), length) the noise of (seed, position) keys over token ids 0..length-1 (`gumbel`):
    the hashes by the CPU kernels where they run (the same integers), the uniforms and logs here."""
    low, high = key_halves(keys)
    module = kernels.compiled()
    if module is not None:
        x = module.noise_hashes(torch.from_numpy(low.view(np.int32)), torch.from_numpy(high.view(np.int32)),
                                length).numpy().view(np.uint32)
    else:
        x = noise_hashes(low, high, length)
    return gumbel_of(open_uniform(x))


def key_halves(keys: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(R,) uint32 each: the low and high halves of each (seed, position) key's 64-bit hash."""
    hashed = noise_keys([s for s, _ in keys], [[t] for _, t in keys])[:, 0]      # (R,)
    return (hashed & np.uint64(0xFFFFFFFF)).astype(np.uint32), (hashed >> np.uint64(32)).astype(np.uint32)


def gumbel_of(u: np.ndarray) -> np.ndarray:
    """-log(-log(u)) of float32 uniforms, in place (NumPy's log: the numbers every device gets)."""
    for _ in range(2):
        np.log(u, out=u)
        np.negative(u, out=u)
    return u


def device_noise_rows(keys: list[tuple[int, int]], length: int, device: torch.device) -> torch.Tensor:
    """`noise_rows` made on `device` by torch's integer operations: the same hashes (32-bit products
    in int64, masked), and each uniform's noise read from `gumbel_table` (made on the host by
    `noise_rows`' own arithmetic), so the numbers are those of the host, bit for bit, whatever the
    device's log."""
    low, high = torch.from_numpy(np.stack(key_halves(keys), 1).astype(np.int64)).to(device).unbind(1)
    x = torch.arange(length, dtype=torch.int64, device=device)[None] ^ low[:, None]             # (R, length)
    x = mix32(mix32(x) ^ high[:, None])
    return gumbel_table(device)[x >> 9]


def mix32(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` on int64 tensors holding uint32 values (any device)."""
    x = x ^ (x >> 16)
    x = times32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = times32(x, 0x846CA68B)
    return x ^ (x >> 16)


def times32(x: torch.Tensor, m: int) -> torch.Tensor:
    """x * m mod 2^32 for int64 tensors holding uint32 values, every product below 2^48 (no overflow)."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


_TABLES: dict[torch.device, torch.Tensor] = {}


def gumbel_table(device: torch.device) -> torch.Tensor:
    """(2^23,) float32 on `device`: the noise of each of the 2^23 uniforms `open_uniform` makes, in
    the order of the hash's top 23 bits (32 MB, made once per device)."""
    if device not in _TABLES:
        u = gumbel_of(open_uniform(np.arange(1 << 23, dtype=np.uint32) << np.uint32(9)))
        _TABLES[device] = torch.from_numpy(u).to(device)
    return _TABLES[device]


def noise_hashes(low: np.ndarray, high: np.ndarray, length: int) -> np.ndarray:
    """(R,) uint32 key halves -> (R, length) uint32: mix32(mix32(v ^ low) ^ high) for token ids v."""
    x = _mix32(np.arange(length, dtype=np.uint32)[None] ^ low[:, None])
    x ^= high[:, None]
    return _mix32(x)


class NoiseRows:
    """The noise rows made lately, by (seed, position), up to `budget` bytes; the oldest go first. A
    row kept shorter than a request needs is made anew (its first columns are the same numbers).
    A request of more than KEYS rows is not kept (`gumbel`)."""
    KEYS = 256  # a decoding step's rows x positions stay well below it

    def __init__(self, budget: int = 64 << 20):
        self.budget, self.kept, self.bytes = budget, OrderedDict(), 0
        self.lock = threading.Lock()

    def rows(self, keys: list[tuple[int, int]], length: int) -> list[np.ndarray]:
        """Each key's row, at least `length` long."""
        with self.lock:
            found = {k: self.kept[k] for k in keys if k in self.kept and len(self.kept[k]) >= length}
            for k in found:
                self.kept.move_to_end(k)
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        if missing:
            made = noise_rows(missing, length)
            found.update(zip(missing, made))
            with self.lock:
                for k, row in zip(missing, made):
                    old = self.kept.pop(k, None)
                    self.bytes += row.nbytes - (0 if old is None else old.nbytes)
                    self.kept[k] = row
                while self.bytes > self.budget:
                    self.bytes -= self.kept.popitem(last=False)[1].nbytes
        return [found[k] for k in keys]


NOISE = NoiseRows()


def open_uniform(x: np.ndarray) -> np.ndarray:
    """uint32 hashes -> float32 uniforms (top 23 bits + 1/2) * 2^-23, in [2^-24, 1 - 2^-24]: every
    value is exact in float32's 24-bit significand, so none rounds to 0 or 1, whose noise would be
    infinite (with 24 bits, (2^24 - 1 + 1/2) rounds up to 2^24 and u to 1)."""
    u = (x >> np.uint32(9)).astype(np.float32)
    u += np.float32(0.5)
    u *= np.float32(2.0 ** -23)
    return u


def perturbed(logits: torch.Tensor, configs: list[SamplingConfig], positions: list[list[int]],
              ids: torch.Tensor | None = None) -> torch.Tensor:
    """(R, n, V) logits of seeded rows -> (R, n, V) log probs + Gumbel noise: its argmax at [r, i]
    is row r's token at sequence position positions[r][i], an exact draw from the probs.
    Verification of a seeded row is greedy acceptance on the target's; a drafter draws a seeded
    row's drafts from its own with the same noise (`Draws`). ids (V,): the target ids of the
    columns (a draft vocabulary), whose noise is used. A column with one finite logit (where a
    grammar allows one token: structured output's forced tokens) is returned as it is: its argmax
    is that token whatever the noise, which is not computed (a forced run's window costs one
    column's noise, not one per token)."""
    # (R, n) the columns with more than one finite logit; None where no grammar masked any (one pass)
    free = None if all_finite(logits) else finite_counts(logits) > 1
    if free is None or bool(free.all()):
        noise = gumbel([cfg.seed for cfg in configs], positions, logits.shape[-1], ids, logits.device)
        return log_weights(logits, configs) + noise
    r, i = free.nonzero(as_tuple=True)
    rows, columns = r.tolist(), i.tolist()
    out = logits.float().clone()
    if rows:
        chosen = [configs[a] for a in rows]
        noise = gumbel([cfg.seed for cfg in chosen], [[positions[a][b]] for a, b in zip(rows, columns)],
                       logits.shape[-1], ids, logits.device)                            # (F, 1, V)
        out[r, i] = (log_weights(logits[r, i][:, None], chosen) + noise)[:, 0]
    return out


def log_weights(logits: torch.Tensor, configs: list[SamplingConfig]) -> torch.Tensor:
    """(R, ..., V) logits of sampled rows -> log row_probabilities up to a constant per row and
    position, which no argmax over V sees: `scaled`; the log of
    the probabilities themselves only where top-p needs them to know what it keeps (a softmax and
    a log over V spared per column)."""
    if any(cfg.top_p is not None and cfg.top_p < 1 for cfg in configs):
        return row_probabilities(logits, configs).log()
    return by_config(scaled, logits, configs)


def all_finite(logits: torch.Tensor) -> bool:
    """Whether every logit is finite (in NumPy on the CPU, as `finite_counts`)."""
    if logits.device.type == "cpu" and not logits.requires_grad:
        return bool(np.isfinite(logits.float().numpy()).all())
    return bool(torch.isfinite(logits).all())


def finite_counts(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) the finite logits of each row (in NumPy on the CPU: one pass, no thread pool)."""
    if logits.device.type == "cpu" and not logits.requires_grad:
        return torch.from_numpy(np.isfinite(logits.float().numpy()).sum(-1))
    return torch.isfinite(logits).sum(-1)


@dataclass
class Draws:
    """Where a proposal's random choices come from, per row (B,). A seeded row's draft at depth d
    (1 = the first draft) is argmax(log draft_probs + g(seed, positions[b] + d - 1)): the noise its
    verifier adds to the target's log-probabilities at that position, so that draft and target agree
    whenever their perturbed argmaxes do (acceptance ~ sum min(target_probs, draft_probs), as with
    rejection sampling; independent noise would give sum target_probs * draft_probs). Other sampled
    rows draw from `generator` (one, or RowGenerators). Under structured output, `grammar` masks each
    constrained row's draft logits to its grammar, depth by depth (guided.DraftGrammar)."""
    generator: torch.Generator | RowGenerators | None = None
    positions: list[int] | None = None  # (B,) sequence position of each row's first draft; None: no seeded rows
    grammar: object | None = None  # guided.DraftGrammar: the rows' grammars walked through their drafts (carried,
    # not read here: naming the type would tie sampling to guided, which builds on it); None: unconstrained

    def scores(self, logits: torch.Tensor, configs: list[SamplingConfig], depth: int,
               ids: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor | None]:
        """logits (B, ..., N) of depth `depth` (0-based) -> the seeded rows and their perturbed
        log-probabilities (R, ..., N) (the same noise across the middle dimensions: the nodes of one
        depth share a position); ([], None) without seeded rows. ids: as `perturbed`."""
        rows = [b for b, cfg in enumerate(configs) if cfg.seeded]
        if not rows:
            return rows, None
        if self.positions is None:
            raise SpecdecError("a seeded row drafts with the noise of its positions: pass Draws(generator, "
                               "positions) with each row's first draft position")
        index = torch.tensor(rows, device=logits.device)
        shape = (len(rows), *logits.shape[1:])
        noise = gumbel([configs[b].seed for b in rows], [[self.positions[b] + depth] for b in rows],
                       logits.shape[-1], ids, logits.device)                                   # (R, 1, N)
        logp = torch.log_softmax(log_weights(logits[index], [configs[b] for b in rows]), -1)
        return rows, (logp.reshape(len(rows), -1, shape[-1]) + noise).view(shape)
