"""Crash-safe saves (specdec/lm/atomic.py): a training run killed at every step of a checkpoint save
resumes to the bit-identical result of an uninterrupted run; leftovers are cleaned; a full disk
and a refused permission are clear errors that leave the previous checkpoint intact.

The kills are deterministic: a forked child counts the file-system operations of one save and
ends itself with os._exit (no cleanup runs, as with SIGKILL) right before operation n, or in the
middle of it for the writes and the final delete.
"""
from __future__ import annotations

import os
import pathlib
import resource
import shutil
import signal
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdec.errors import SpecdecError
from specdec.lm.atomic import atomic_dir, recover
from specdec.train import loop
from specdec.train.config import TrainConfig
from specdec.train.loop import train
from specdec.train.presets import PRESETS

KILLED = 77
JSON_PKG = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
# what a training run's work folder may hold once resumed: no temporary or retired copies
WORK_FILES = {"prepared.json", "tokenizer.json", "tokens-train.npy", "tokens-valid.npy", "tokens-test.npy", "state"}


def dying_at(n: int):
    """A wrapper of file-system calls for a child process: call n (counting from 0) across every call
    it wraps ends the process with KILLED before it happens."""
    count = [0]

    def kill_point(real):
        def op(*args, **kwargs):
            if count[0] == n:
                os._exit(KILLED)
            count[0] += 1
            return real(*args, **kwargs)
        return op
    return kill_point

def cfg(out: Path) -> TrainConfig:
    preset = dict(PRESETS["tiny"])
    preset.update(corpus=[JSON_PKG], eval_windows=2, steps=4, save_every=2, eval_every=100)
    return TrainConfig(out=str(out), **preset)


def in_child(body) -> int:
    """Run body() in a forked child; return its exit status (the child never returns here)."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
            code = 0
        except BaseException:  # noqa: BLE001 - any escape is a failure reported by the status
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def train_killed_in_second_save(out: Path, n: int, partial: bool) -> int:
    """Train in a child that dies before (or, with `partial`, in the middle of) operation n of the
    run's second state save; the exit status says whether it died (KILLED) or finished (0)."""
    def body():
        ops = {"count": 0, "armed": False}

        def kill_point(real, half=None):
            def op(*args, **kwargs):
                if ops["armed"]:
                    if ops["count"] == n:
                        if partial and half is not None:
                            half(real, *args, **kwargs)
                        os._exit(KILLED)
                    ops["count"] += 1
                return real(*args, **kwargs)
            return op

        def half_write(real, *args, **kwargs):  # the file is written, then cut in half
            real(*args, **kwargs)
            path = Path(args[1] if real is real_save_file else args[0])
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

        def half_delete(real, path, *args, **kwargs):  # one file of the folder is gone
            files = sorted(p for p in Path(path).iterdir() if p.is_file())
            if files:
                files[0].unlink()

        real_save_file, real_write_text = loop.save_file, pathlib.Path.write_text
        loop.save_file = kill_point(real_save_file, half_write)
        pathlib.Path.write_text = kill_point(real_write_text, half_write)
        os.replace, os.fsync = kill_point(os.replace), kill_point(os.fsync)
        shutil.rmtree = kill_point(shutil.rmtree, half_delete)
        real_save_state, saves = loop.Run.save_state, []

        def save_state(self, *args, **kwargs):
            saves.append(1)
            ops["armed"] = len(saves) == 2
            real_save_state(self, *args, **kwargs)
            ops["armed"] = False
        loop.Run.save_state = save_state
        train(cfg(out))
    return in_child(body)


def test_a_run_killed_at_every_step_of_a_save_resumes_bit_identical(tmp_path, monkeypatch):
    """Restarting from step 0 would also end bit-identical (batches are a function of the step),
    so the test also checks where the resumed run started: from the first save (step 2) when
    killed before the new copy was complete, from the second (step 4) once it was."""
    reference = load_file(train(cfg(tmp_path / "reference")) / "model.safetensors")
    real_load_state, started = loop.Run.load_state, []
    monkeypatch.setattr(loop.Run, "load_state",
                        lambda self, *a: started.append(real_load_state(self, *a)[0]) or real_load_state(self, *a))
    cases = failures = 0
    for partial in (False, True):
        n = 0
        while True:
            out = tmp_path / f"kill-{n}-{'partial' if partial else 'before'}"
            status = train_killed_in_second_save(out, n, partial)
            assert status in (KILLED, 0), f"the child failed at operation {n}"
            if status == 0:  # n is past the save's last operation: every kill point was tried
                break
            resumed = load_file(train(cfg(out)) / "model.safetensors")
            cases += 1
            # operations 0-4 write and fsync the new copy, 5 renames it to .state.new: complete from then on
            assert started[-1] == (4 if n > 5 else 2), f"kill {n} ({partial=}): resumed from step {started[-1]}"
            failures += not (resumed.keys() == reference.keys()
                             and all(torch.equal(resumed[k], reference[k]) for k in reference))
            assert {p.name for p in (out / "work").iterdir()} <= WORK_FILES, f"leftovers after kill {n}"
            n += 1
    print(f"fault injection: {cases} kills, {failures} resumed runs differ")
    assert cases == 20 and failures == 0  # 10 operations killed before, then again with the writes and the delete half done


def test_recover_puts_back_a_retired_copy_and_deletes_orphans(tmp_path):
    """The state the issue found: a save killed between its renames by the old sequence left only
    .state.old and a tempfile folder; the next run must resume from .state.old."""
    (tmp_path / ".state.old").mkdir()
    (tmp_path / ".state.old" / "state.json").write_text("{}")
    (tmp_path / ".state.k2j_x9ab").mkdir()
    (tmp_path / ".state.tmp-12-abcdef").mkdir()
    (tmp_path / ".statex.tmp-1").mkdir()  # another folder's name: left alone
    recover(tmp_path / "state")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".statex.tmp-1", "state"]
    assert (tmp_path / "state" / "state.json").exists()


def test_saved_folders_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "m") as tmp:
            (tmp / "a.json").write_text("{}")
            os.chmod(tmp / "a.json", 0o600)  # a writer that creates private files
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "m" / "a.json").stat().st_mode & 0o777 == 0o644


def test_a_full_disk_is_a_clear_error_and_the_previous_copy_survives(tmp_path):
    """A file-size limit (RLIMIT_FSIZE) makes the kernel refuse the write, as a full disk does."""
    from specdec.lm.checkpoint import load_model, save_model
    from tests.conftest import tiny_model
    save_model(tiny_model(), tmp_path / "m", dtype=torch.float32)
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    def body():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            save_model(tiny_model(seed=1), tmp_path / "m", dtype=torch.float32)
        except SpecdecError as e:
            assert "cannot save" in str(e) and "disk is full" in str(e) and "intact" in str(e), str(e)
            os._exit(KILLED)
    assert in_child(body) == KILLED
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    load_model(tmp_path / "m")


def test_a_refused_permission_is_a_clear_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)

    def body():
        if os.geteuid() == 0:
            os.setuid(65534)  # root may write anywhere: become nobody
        try:
            with atomic_dir(locked / "model") as tmp:
                (tmp / "x").write_text("x")
        except SpecdecError as e:
            assert "permission denied" in str(e) and "--out" in str(e), str(e)
            os._exit(KILLED)
    if os.geteuid() != 0:
        locked.chmod(0o555)
    assert in_child(body) == KILLED
    assert list(locked.iterdir()) == []


def test_the_command_reports_an_unwritable_run_folder_plainly(tmp_path):
    """Beyond checkpoints: any write the command makes (here the prepared corpus) into a folder it
    may not write ends in one clear line, not a traceback."""
    from specdec.cli import main
    base = Path(tempfile.mkdtemp())  # outside pytest's private tmp folders, so another user can enter
    try:
        base.chmod(0o755)
        shutil.copytree(JSON_PKG, base / "corpus")
        (base / "locked").mkdir(mode=0o755)
        err = tmp_path / "err.txt"

        def body():
            with open(err, "w") as sys.stderr:
                if os.geteuid() == 0:
                    os.setuid(65534)  # root may write anywhere: become nobody
                code = main(["train", "--preset", "tiny", "--corpus", str(base / "corpus"),
                             "--out", str(base / "locked" / "run")])
            os._exit(KILLED if code == 2 else 1)
        if os.geteuid() != 0:
            (base / "locked").chmod(0o555)
        assert in_child(body) == KILLED
        text = err.read_text()
        assert f"specdec: error: Permission denied: {base / 'locked' / 'run'}" in text and "Traceback" not in text
        assert list((base / "locked").iterdir()) == []
    finally:
        (base / "locked").chmod(0o755)
        shutil.rmtree(base)


def test_a_recovery_killed_at_every_step_still_ends_with_the_newest_copy(tmp_path):
    """recover() itself may be killed (a second crash during the resume): each of its steps is a
    rename or a delete, and running it again finishes the job."""
    def layout(root: Path, with_dest: bool) -> Path:
        for name, text in ((".state.new", "new"), ("state", "old") if with_dest else (".state.old", "older")):
            (root / name).mkdir(parents=True)
            (root / name / "state.json").write_text(text)
        (root / ".state.tmp-1-abcdef").mkdir()
        return root / "state"

    cases = 0
    for with_dest in (True, False):
        n = 0
        while True:
            dest = layout(tmp_path / f"{with_dest}-{n}", with_dest)

            def body():
                kill_point = dying_at(n)
                os.replace, shutil.rmtree = kill_point(os.replace), kill_point(shutil.rmtree)
                recover(dest)
            status = in_child(body)
            recover(dest)
            assert (dest / "state.json").read_text() == "new", f"kill {n}"
            assert sorted(p.name for p in dest.parent.iterdir()) == ["state"]
            cases += 1
            if status == 0:
                break
            n += 1
    print(f"recovery: {cases} kills, 0 lost copies")
    assert cases >= 6
