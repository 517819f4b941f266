"""First uses of a GGUF file by several processes at once (lm/gguf.py, lm/atomic.py): a bench and a
generate started together, two server workers. Every process gets the one finished folder; a
conversion killed at any point leaves nothing that a later run takes for a finished folder.

The concurrent processes are real (subprocesses of this interpreter, all released at once once
they have imported specdec); the kills are deterministic, as in test_atomic.py: a forked child
ends itself with os._exit (no cleanup, as with SIGKILL) right before its n-th file-system write.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import safetensors.torch
from safetensors.torch import load_file

from specdec.lm import gguf
from specdec.lm.checkpoint import CONFIG, META, WEIGHTS

from ..gguf_helpers import byte_level_tokenizer, hf_model, write_gguf
from .test_atomic import KILLED, dying_at, in_child

REPO = Path(__file__).resolve().parents[2]
PROCESSES = 4
# each process: import, say "ready", wait for the word, convert (or wait for the conversion), print the folder
FIRST_USE = ("import sys\nfrom specdec.lm import gguf\nprint('ready', flush=True)\nsys.stdin.readline()\n"
             "print(gguf.folder(sys.argv[1]), flush=True)\n")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("file") / "tiny.gguf", hf_model("llama"), byte_level_tokenizer(), "llama")


@pytest.fixture(scope="module")
def reference(gguf_file, tmp_path_factory) -> dict:
    """The files of an undisturbed conversion, by name (the weights as tensors, the rest as text)."""
    root = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "cache_root", lambda: root)
        return contents(gguf.folder(gguf_file))


def contents(folder: Path) -> dict:
    files = {}
    for f in sorted(folder.iterdir()):
        files[f.name] = load_file(f) if f.name == WEIGHTS else f.read_text()
    if META in files:  # it names the file's path, which differs between runs
        files[META] = {k: v for k, v in json.loads(files[META])["converted_from"].items() if k != "path"}
    return files


def same(got: dict, expected: dict) -> bool:
    weights, want = got.get(WEIGHTS, {}), expected[WEIGHTS]
    return (got.keys() == expected.keys() and weights.keys() == want.keys()
            and all(weights[k].equal(want[k]) for k in want)
            and all(got[k] == expected[k] for k in expected if k != WEIGHTS))


def test_concurrent_first_uses_all_get_the_one_finished_folder(gguf_file, reference, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_USE, str(gguf_file)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(PROCESSES)]
    for proc in procs:  # every process has imported specdec: none can be done before the others start
        assert proc.stdout.readline() == "ready\n", proc.communicate()[1]
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [proc.communicate() for proc in procs]
    failed = [err.strip().splitlines()[-1:] for (_, err), proc in zip(results, procs) if proc.returncode != 0]
    assert not failed, f"{len(failed)} of {PROCESSES} first uses failed: {failed}"
    folders = {out.strip() for out, _ in results}
    assert len(folders) == 1
    folder = Path(folders.pop())
    assert same(contents(folder), reference)
    assert sum("converting tiny.gguf to a checkpoint folder" in err for _, err in results) == 1  # once; others waited
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no lock, copy or leftover beside it


def conversion_killed_at(gguf_file: Path, root: Path, n: int) -> int:
    """Convert in a child that dies right before its n-th file-system write (a file written, a file
    fsynced, a rename, a delete); KILLED if it died, 0 if the conversion finished first."""
    def body():
        kill_point = dying_at(n)
        gguf.cache_root = lambda: root
        safetensors.torch.save_file = kill_point(safetensors.torch.save_file)
        pathlib.Path.write_text = kill_point(pathlib.Path.write_text)
        os.replace, os.fsync, shutil.rmtree = kill_point(os.replace), kill_point(os.fsync), kill_point(shutil.rmtree)
        gguf.folder(gguf_file)
    return in_child(body)


def test_a_conversion_killed_at_any_point_leaves_nothing_taken_for_finished(gguf_file, reference, tmp_path,
                                                                           monkeypatch):
    """After each kill the cache holds either no folder or the complete one; the next use then
    converts (or reuses) and leaves the complete folder alone in its place."""
    n = 0
    while True:
        root = tmp_path / f"kill-{n}"
        status = conversion_killed_at(gguf_file, root, n)
        assert status in (KILLED, 0), f"the conversion failed at write {n}"
        finished = [p for p in root.rglob(CONFIG) if not p.parent.name.startswith(".")]
        assert all(same(contents(p.parent), reference) for p in finished), f"killed at write {n}: a partial folder"
        monkeypatch.setattr(gguf, "cache_root", lambda: root)
        folder = gguf.folder(gguf_file)
        assert same(contents(folder), reference), f"killed at write {n}"
        assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name], f"leftovers after kill {n}"
        if status == 0:  # n is past the conversion's last write: every kill point was tried
            break
        n += 1
    # 4 writes (weights, config, tokenizer_config rewritten, metadata), 7 fsyncs (6 files, the folder), 2 renames,
    # the fsync of the cache folder, the delete of a retired copy
    assert n == 15


def test_threads_of_one_process_share_the_lock_as_processes_do(gguf_file, reference, tmp_path, monkeypatch, capsys):
    """Server workers may be threads: the lock is taken per open file, so threads wait as processes do."""
    monkeypatch.setattr(gguf, "cache_root", lambda: tmp_path)
    start = threading.Barrier(PROCESSES)

    def first_use() -> Path:
        start.wait()
        return gguf.folder(gguf_file)
    with ThreadPoolExecutor(PROCESSES) as pool:
        folders = set(pool.map(lambda _: first_use(), range(PROCESSES)))
    assert len(folders) == 1 and same(contents(folders.pop()), reference)
    assert capsys.readouterr().err.count("converting tiny.gguf to a checkpoint folder") == 1
