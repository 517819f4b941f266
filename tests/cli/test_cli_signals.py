"""Commands that stop cleanly, as real processes: SIGTERM or Ctrl-C (SIGINT) during `specdec train`
ends with one line naming the command that resumes, the state of the last finished step saved
(the resumed run ends where an uninterrupted one does) and a checkpoint `generate --model` loads;
a second signal leaves at once with the line naming it; during `specdec generate`, and during the
imports of start-up, one line, no traceback, exit status 143 or 130. Plus `--version` and
`--prompt-file`. Each test sends its signal once the process has reported the state it tests (a
finished step, a first piece of text, an import done), never after a number of seconds.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JSON_PKG = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def specdec(*args: str, python: tuple[str, ...] = (), **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *python, "-m", "specdec.cli", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


class Output:
    """A process's stdout and stderr read as they come (threads), so that a test waits for what the
    process reports, never for a number of seconds."""
    HANG = 600  # seconds: a process that never reports the state fails the test instead of hanging it

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.text, self.changed = proc, {"out": "", "err": ""}, threading.Condition()
        self.readers = [threading.Thread(target=self.read, args=(name, stream), daemon=True)
                        for name, stream in (("out", proc.stdout), ("err", proc.stderr))]
        for reader in self.readers:
            reader.start()

    def read(self, name: str, stream) -> None:
        for chunk in iter(lambda: stream.read(1), ""):
            with self.changed:
                self.text[name] += chunk
                self.changed.notify_all()
        with self.changed:
            self.text[name + " closed"] = True
            self.changed.notify_all()

    def wait_for(self, name: str, pattern: str) -> re.Match:
        """The first match of `pattern` in the stream `name` ("out" or "err"), once it has come."""
        with self.changed:
            found = self.changed.wait_for(lambda: re.search(pattern, self.text[name]) or name + " closed" in self.text,
                                          timeout=self.HANG)
            match = re.search(pattern, self.text[name])
        assert match, f"never came on std{name}: {pattern!r} ({found=}); stderr: {self.text['err'][-2000:]}"
        return match

    def finish(self) -> tuple[str, str, int]:
        """stdout, stderr and the exit status, once the process has ended."""
        status = self.proc.wait(timeout=self.HANG)
        for reader in self.readers:
            reader.join()
        return self.text["out"], self.text["err"], status


STEPS = 100_000  # far more than a test waits for (a tiny step takes milliseconds)
TRAIN = ["train", "--preset", "tiny", "--corpus", JSON_PKG, "--steps", str(STEPS), "--save-every", "1000",
         "--eval-every", "1000"]


def first_steps(out: Path) -> tuple[subprocess.Popen, Output, int]:
    """A training run, once its progress bar reports a finished step: (process, output, that step)."""
    proc = specdec(*TRAIN, "--out", str(out))
    output = Output(proc)
    step = int(output.wait_for("err", rf"\| *([1-9][0-9]*)/{STEPS} ").group(1))
    return proc, output, step


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_training_saves_the_step_and_says_how_to_resume(tmp_path, signum):
    out = tmp_path / "run"
    proc, output, seen = first_steps(out)
    proc.send_signal(signum)
    stdout, stderr, status = output.finish()
    assert status == 0, stderr
    assert "Traceback" not in stderr + stdout
    said = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
    assert f"specdec: {said}: stopping after the step under way, its state saved (again to leave at once)" in stderr
    step = json.loads((out / "work" / "state" / "state.json").read_text())["step"]
    assert seen <= step < STEPS  # saved at the signal, not at save_every
    line = stdout.strip().splitlines()[-1]
    assert f"stopped at step {step} of {STEPS}" in line and "resume with: specdec train --preset tiny" in line
    assert f"specdec generate --model {out / 'latest'}" in line
    generated = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(out / "latest"),
                                "--prompt", "import", "--max-new-tokens", "4", "--json"], env=ENV,
                               capture_output=True, text=True)
    assert generated.returncode == 0, generated.stderr
    assert len(json.loads(generated.stdout)["tokens"]) == 4


def test_a_second_signal_during_training_leaves_at_once_naming_it(tmp_path):
    proc, output, _ = first_steps(tmp_path / "run")
    proc.send_signal(signal.SIGTERM)
    output.wait_for("err", "SIGTERM: stopping after the step under way")  # two at once would be one
    proc.send_signal(signal.SIGTERM)
    _, stderr, status = output.finish()
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "specdec: train stopped by SIGTERM" and status == 143


def test_a_signal_during_generate_is_one_line():
    proc = specdec("generate", "--stream", "--prompt", "def f(x):\n", "--max-new-tokens", "900")
    output = Output(proc)
    output.wait_for("out", "def f")  # the prompt comes out with the first generated piece
    proc.send_signal(signal.SIGTERM)
    _, stderr, status = output.finish()
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "specdec: generate stopped by SIGTERM" and status == 143


@pytest.mark.parametrize("signum, line, code", [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGINT, "Ctrl-C", 130)])
def test_a_signal_while_importing_is_the_same_one_line(signum, line, code):
    """Sent in the middle of `import torch` (python -X importtime reports each import as it ends):
    an exception raised there would be swallowed by numpy's import or abort the process later."""
    proc = specdec("generate", "--prompt", "def f(x):", "--max-new-tokens", "900", python=("-X", "importtime"))
    output = Output(proc)
    output.wait_for("err", r"\| +torch\._C\n")  # torch's extension is loaded; torch's import goes on
    proc.send_signal(signum)
    _, stderr, status = output.finish()
    said = [s for s in stderr.splitlines() if not s.startswith("import time:")]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert said == [f"specdec: generate stopped by {line}"] and status == code


def test_version_and_prompt_from_stdin():
    version = subprocess.run([sys.executable, "-m", "specdec.cli", "--version"], env=ENV, capture_output=True,
                             text=True)
    assert version.stdout.startswith("specdec ") and version.returncode == 0
    from_stdin = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt-file", "-",
                                 "--max-new-tokens", "5", "--json"], input="def f(x):", env=ENV, capture_output=True,
                                text=True, timeout=120)
    from_flag = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt", "def f(x):",
                                "--max-new-tokens", "5", "--json"], env=ENV, capture_output=True, text=True,
                               timeout=120)
    assert json.loads(from_stdin.stdout)["tokens"] == json.loads(from_flag.stdout)["tokens"]
