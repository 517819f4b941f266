"""Commands that stop cleanly, as real processes: SIGTERM or Ctrl-C (SIGINT) during `specdec train`
ends with one line naming the command that resumes, the state of the last finished step saved
(the resumed run ends where an uninterrupted one does) and a checkpoint `generate --model` loads;
during `specdec generate` one line and no traceback. Plus `--version` and `--prompt-file`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
JSON_PKG = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def specdec(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specdec.cli", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def wait_for_data(out: Path, timeout: float = 120) -> None:
    """Until the run has prepared its data (training starts next)."""
    deadline = time.monotonic() + timeout
    while not (out / "work" / "prepared.json").exists():
        assert time.monotonic() < deadline, "training never prepared its data"
        time.sleep(0.1)


STEPS = 100_000  # far more than the 3 s before the signal can run on any machine (a tiny step takes ~7 ms)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_training_saves_the_step_and_says_how_to_resume(tmp_path, signum):
    out = tmp_path / "run"
    command = ["train", "--preset", "tiny", "--corpus", JSON_PKG, "--out", str(out), "--steps", str(STEPS),
               "--save-every", "1000", "--eval-every", "1000"]
    proc = specdec(*command)
    wait_for_data(out)
    time.sleep(3.0)  # some steps (a step of the tiny preset takes milliseconds)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr + stdout
    step = json.loads((out / "work" / "state" / "state.json").read_text())["step"]
    assert 0 < step < STEPS  # saved at the signal, not at save_every
    line = stdout.strip().splitlines()[-1]
    assert f"stopped at step {step} of {STEPS}" in line and "resume with: specdec train --preset tiny" in line
    assert f"specdec generate --model {out / 'latest'}" in line
    generated = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(out / "latest"),
                                "--prompt", "import", "--max-new-tokens", "4", "--json"], env=ENV,
                               capture_output=True, text=True, timeout=120)
    assert generated.returncode == 0, generated.stderr
    assert len(json.loads(generated.stdout)["tokens"]) == 4


def test_a_signal_during_generate_is_one_line():
    proc = specdec("generate", "--prompt-file", "-", "--max-new-tokens", "900", stdin=subprocess.PIPE)
    proc.stdin.write("def f(x):\n")
    proc.stdin.close()
    proc.stdin = None
    time.sleep(2.5)  # loading or generating (900 tokens take seconds): either stops with one line
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "specdec: generate stopped by SIGTERM" and proc.returncode == 143


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
