"""llama.cpp's own programs as a peer: `llama-bench` for decoding speed, `llama-speculative-simple`
for its speculative decoding with a draft model, `llama-lookup` for its prompt-lookup decoding,
`llama-quantize` for its quantized files.

The Python binding (bench/llamacpp.py) is one build of llama.cpp; its own binaries, built natively
on the machine that runs them (`cmake -DGGML_NATIVE=ON`, the default), are its best. They are found
in the folder named by `--llama-cpp DIR` or the environment variable SPECDEC_LLAMA_CPP (a build's
`bin/` folder), never downloaded. Each function runs one program once and returns its own figures;
interleaving and repeats are the caller's.

This module knows nothing about specdec's model classes.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdecError

ENV = "SPECDEC_LLAMA_CPP"
BUILD_HINT = ("build llama.cpp natively (cmake -B build -DGGML_NATIVE=ON && cmake --build build --target "
              "llama-bench llama-speculative-simple llama-lookup llama-quantize) and pass its build/bin folder")


def binaries(folder: str | Path | None = None) -> Path:
    """The folder of llama.cpp's programs: `folder`, else $SPECDEC_LLAMA_CPP."""
    folder = folder or os.environ.get(ENV)
    if not folder:
        raise SpecdecError(f"no llama.cpp build named: pass --llama-cpp DIR or set {ENV} ({BUILD_HINT})")
    folder = Path(folder).expanduser()
    if not (folder / "llama-bench").is_file():
        raise SpecdecError(f"{folder} has no llama-bench: {BUILD_HINT}")
    return folder


def build(bin_dir: Path) -> str:
    """How the programs in `bin_dir` were built, from their build folder's CMakeCache.txt: "native"
    (GGML_NATIVE=ON: every instruction set of the building machine) or the instruction sets it was
    told to use."""
    cache = bin_dir.parent / "CMakeCache.txt"
    if not cache.is_file():
        return "unknown build (no CMakeCache.txt beside its bin folder)"
    flags = dict(re.findall(r"^GGML_(\w+):BOOL=(\w+)$", cache.read_text(errors="replace"), re.M))
    if flags.get("NATIVE") == "ON":
        return "its own programs, native build (GGML_NATIVE=ON)"
    isas = [name for name in ("AVX", "AVX2", "FMA", "F16C", "AVX_VNNI", "AVX512", "AVX512_VNNI", "AVX512_BF16",
                              "AMX_INT8") if flags.get(name) == "ON"]
    return f"its own programs, GGML_NATIVE=OFF, built for {' '.join(isas) or 'no vector extension'}"


class ProgramFailed(SpecdecError):
    """A program that exited with a non-zero status (`status`; negative: killed by that signal)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def run(program: Path, args: list[str]) -> subprocess.CompletedProcess:
    """One run, its stdout and stderr kept apart; a failure (a crash included) is an error naming the
    exit status."""
    done = subprocess.run([str(program), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ProgramFailed(f"{program.name} failed (exit status {done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[-400:]}", done.returncode)
    return done


def decode_speed(bin_dir: Path, model: Path, threads: int, new_tokens: int) -> float:
    """llama-bench's decoding speed (tokens/s) of `new_tokens` tokens from an empty context, one run."""
    return float(decode_bench(bin_dir, model, threads, new_tokens)["avg_ts"])


def decode_bench(bin_dir: Path, model: Path, threads: int, new_tokens: int) -> dict:
    """llama-bench's row of that run, as its JSON has it: avg_ts (tokens/s), and its build (build_commit,
    build_number), CPU and backends."""
    done = run(bin_dir / "llama-bench", ["-m", str(model), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
                                         "-r", "1", "-o", "json"])
    return json.loads(done.stdout)[0]  # the JSON alone: its log goes to stderr


@dataclass
class Speculative:
    """One `llama-speculative-simple` run: its decoding time and counts, as it prints them."""
    decoded: int            # tokens decoded (the prompt excluded)
    seconds: float          # decoding time, the prompt's encoding excluded
    drafted: int
    accepted: int
    text: str               # everything it printed (its log and statistics go to stderr)

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.seconds


SPEC_FIGURES = {"decoded": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", "drafted": r"n_drafted\s*=\s*(\d+)",
                "accepted": r"n_accept\s*=\s*(\d+)"}


def parse_speculative(out: str) -> Speculative:
    """The figures of llama-speculative-simple's closing statistics."""
    found = {key: re.search(pattern, out) for key, pattern in SPEC_FIGURES.items()}
    missing = [key for key, m in found.items() if m is None]
    if missing:
        raise SpecdecError(f"llama-speculative-simple printed no {', '.join(missing)}: {out.strip()[-300:]}")
    return Speculative(int(found["decoded"].group(1)), float(found["decoded"].group(2)),
                       int(found["drafted"].group(1)), int(found["accepted"].group(1)), out)


@functools.cache
def usage(program: Path) -> str:
    """What `program --help` prints, asked once per program."""
    done = run(program, ["--help"])
    return done.stdout + done.stderr


def draft_flags(program: Path, draft_max: int, draft_type: str | None = None) -> list[str]:
    """The flags that ask `program` for drafts of up to `draft_max` tokens, as its version spells them:
    builds since late 2025 take `--spec-draft-n-max` and infer no draft type from a plain GGUF draft
    (`--spec-type draft_type`, where one is given); earlier ones take `--draft-max`."""
    if "--spec-draft-n-max" in usage(program):
        return [*(["--spec-type", draft_type] if draft_type else []), "--spec-draft-n-max", str(draft_max)]
    return ["--draft-max", str(draft_max)]


def speculative(bin_dir: Path, target: Path, draft: Path, prompt_file: Path, new_tokens: int, draft_max: int,
                threads: int, extra: tuple[str, ...] = ()) -> Speculative:
    """Greedy speculative decoding of the prompt in `prompt_file` by llama.cpp with the draft model,
    drafts of up to `draft_max` tokens, its other speculative settings at their defaults (e.g. it
    ends a draft whose probability falls below its p_min); `extra`: more of its flags."""
    program = bin_dir / "llama-speculative-simple"
    done = run(program, ["-m", str(target), "-md", str(draft), "-f", str(prompt_file), "-n", str(new_tokens),
                         "-t", str(threads), "-td", str(threads), "--temp", "0", "-c", "4096",
                         *draft_flags(program, draft_max, "draft-simple"), *extra])
    return parse_speculative(done.stdout + done.stderr)


def lookup(bin_dir: Path, target: Path, prompt_file: Path, new_tokens: int, draft_max: int,
           threads: int, extra: tuple[str, ...] = ()) -> Speculative:
    """Greedy prompt-lookup decoding of the prompt in `prompt_file` by llama.cpp (`llama-lookup`:
    drafts of up to `draft_max` tokens from the n-grams of the text so far, no draft model); it
    prints the statistics llama-speculative-simple prints."""
    program = bin_dir / "llama-lookup"
    done = run(program, ["-m", str(target), "-f", str(prompt_file), "-n", str(new_tokens), "-t", str(threads),
                         "--temp", "0", "-c", "4096", *draft_flags(program, draft_max), *extra])
    return parse_speculative(done.stdout + done.stderr)


class Fallback:
    """A program run with its defaults until it crashes (killed by a signal, as some builds' weight
    repacking does beside a draft model), then with `--no-repack` from that run on; what happened is
    kept in `failures` (program -> what it printed), for the conditions: a peer's failure is reported,
    never hidden."""
    FLAGS = ("--no-repack",)

    def __init__(self):
        self.flags: dict[str, tuple[str, ...]] = {}
        self.failures: dict[str, str] = {}

    def __call__(self, name: str, call):
        """call(extra flags) for program `name`, again with FLAGS after a crash."""
        try:
            return call(self.flags.get(name, ()))
        except ProgramFailed as e:
            if name in self.flags or e.status >= 0:
                raise
            self.failures[name] = f"{str(e)[:160]}...; run with {' '.join(self.FLAGS)} from then on"
            self.flags[name] = self.FLAGS
            return call(self.FLAGS)


def quantize(bin_dir: Path, source: Path, out: Path, kind: str = "Q8_0", flags: tuple[str, ...] = ()) -> Path:
    """llama.cpp's quantization of a GGUF file, written once (atomically) and then reused; `flags`: more
    of llama-quantize's options (--allow-requantize, --imatrix FILE)."""
    if not out.exists():
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            run(bin_dir / "llama-quantize", [*flags, str(source), str(tmp), kind])
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out
