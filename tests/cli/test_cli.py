"""The `specdec` command: the generate contract, and clear errors that leave nothing behind."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from specdec.cli import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_contract_through_the_console_script(tiny_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(tiny_checkpoint),
                           "--prompt", "def f(x):", "--max-new-tokens", "9", "--temperature", "0", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["tokens"]) <= 9 and isinstance(out["text"], str)
    assert out["finish_reason"] in {"eos", "length"}
    assert out["stats"]["new_tokens"] == len(out["tokens"]) and out["stats"]["tokens_per_s"] > 0


def test_seeded_sampling_is_reproducible(capsys, tiny_checkpoint):
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "import", "--max-new-tokens", "12",
            "--temperature", "0.9", "--top-k", "50", "--top-p", "0.95", "--seed", "7", "--json"]
    first = json.loads(run_cli(capsys, *args)[1])
    second = json.loads(run_cli(capsys, *args)[1])
    assert first["tokens"] == second["tokens"]


@pytest.fixture
def broken(tmp_path, tiny_checkpoint):
    def make(kind):
        path = tmp_path / kind
        shutil.copytree(tiny_checkpoint, path)
        if kind == "corrupt":
            data = (path / "model.safetensors").read_bytes()
            (path / "model.safetensors").write_bytes(data[: len(data) // 2])
        elif kind == "mismatch":
            cfg = json.loads((path / "config.json").read_text())
            cfg["intermediate_size"] += 8
            (path / "config.json").write_text(json.dumps(cfg))
        elif kind == "no-weights":
            (path / "model.safetensors").unlink()
        elif kind == "bad-json":
            (path / "config.json").write_text("{")
        return str(path)
    return make


@pytest.mark.parametrize("kind, message", [
    ("corrupt", "corrupt or truncated"),
    ("mismatch", "does not match"),
    ("no-weights", "has no model.safetensors"),
    ("bad-json", "not valid JSON"),
])
def test_broken_checkpoints_are_clear_errors(capsys, broken, kind, message):
    code, _, err = run_cli(capsys, "generate", "--model", broken(kind), "--prompt", "x")
    assert code == 2 and message in err


@pytest.mark.parametrize("extra, message", [
    (["--prompt", ""], "empty"),
    (["--prompt", "x " * 400], "positions but the model's context is"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "x", "--top-k", "0"], "top_k must be >= 1"),
    (["--prompt", "x", "--max-new-tokens", "-1"], "max_new_tokens must be >= 0"),
    (["--humaneval", "999"], "HumanEval has prompts"),
    ([], "exactly one of --prompt"),
])
def test_bad_generation_input_is_a_clear_error(capsys, tiny_checkpoint, extra, message):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_checkpoint), *extra)
    assert code == 2 and message in err and out == ""


def test_missing_model_and_unreadable_corpus_leave_nothing_on_disk(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert code == 2 and "no checkpoint folder" in err
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--corpus", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "run"))
    assert code == 2 and "does not exist" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("draft, flags", [("ngram", []), ("draft-model", []),
                                          ("draft-model", ["--draft-vocab", "auto", "--stop-below", "0.5"])])
def test_speculative_generate_prints_the_same_tokens_with_acceptance_stats(capsys, tiny_checkpoint, draft, flags):
    base = ["generate", "--model", str(tiny_checkpoint), "--prompt", "def f(x):", "--max-new-tokens", "16", "--json"]
    plain = json.loads(run_cli(capsys, *base)[1])
    options = ["--draft-model", str(tiny_checkpoint), *flags] if draft == "draft-model" else []
    code, out, err = run_cli(capsys, *base, "--draft", draft, *options, "-k", "3")
    assert code == 0, err
    spec = json.loads(out)
    assert spec["tokens"] == plain["tokens"]
    stats = spec["stats"]
    for key in ("steps", "proposed", "accepted", "accepted_per_position", "acceptance_rate",
                "mean_acceptance_length"):
        assert key in stats
    assert stats["method"] == draft and len(stats["accepted_per_position"]) == 3
    assert stats["mean_acceptance_length"] == pytest.approx(len(spec["tokens"]) / stats["steps"])


def test_draft_with_another_tokenizer_and_negative_k_are_clear_errors(capsys, tmp_path, tiny_checkpoint):
    from specdec.lm.tokenizer import Tokenizer
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    Tokenizer.train(["completely different text " * 50], 384).save(other / "tokenizer.json")
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_checkpoint), "--prompt", "x",
                           "--draft", "draft-model", "--draft-model", str(other))
    assert code == 2 and "another tokenizer" in err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_checkpoint), "--prompt", "x",
                           "--draft", "ngram", "-k", "-1")
    assert code == 2 and "must be >= 0" in err


def test_k0_footer_says_na_where_the_json_says_null(capsys, tiny_checkpoint):
    base = ["generate", "--model", str(tiny_checkpoint), "--prompt", "def f(x):", "--max-new-tokens", "6",
            "--draft", "ngram", "-k", "0"]
    code, out, _ = run_cli(capsys, *base, "--json")
    assert code == 0 and json.loads(out)["stats"]["acceptance_rate"] is None
    code, out, err = run_cli(capsys, *base)
    assert code == 0 and "ngram k=0: acceptance rate n/a" in err and out.startswith("def f(x):")


def test_a_prompt_ending_in_whitespace_is_printed_as_given(capsys, tiny_checkpoint):
    prompt = "def f(x):\n    "
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_checkpoint), "--prompt", prompt,
                           "--max-new-tokens", "5", "--json")
    text = json.loads(out)["text"]
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_checkpoint), "--prompt", prompt,
                           "--max-new-tokens", "5")
    assert code == 0 and out == prompt + text + "\n"


def test_generate_streams_to_a_terminal_chunk_by_chunk(capsys):
    """In a terminal (a pseudo-terminal here) the text appears piece by piece as tokens are
    committed, and adds up to the text that --json reports at the end. The shipped target writes
    text: a random model's control characters would make the terminal split even one write."""
    import os
    import pty
    import select
    args = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "48", "--threads", "1"]
    text = json.loads(run_cli(capsys, *args, "--json")[1])["text"]
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", *args], stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    chunks = []
    while select.select([leader], [], [], 120)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(60) == 0, proc.stderr.read()
    shown = b"".join(chunks).decode().replace("\r\n", "\n")
    assert shown == "def f(x):" + text + "\n"
    assert len(chunks) > 10, chunks  # in pieces as they come, not one write at the end


def test_json_leaves_out_positions_never_drafted_and_the_footer_counts_in_words(capsys, tiny_checkpoint):
    """Two new tokens with k = 4: one step drafted one token, positions 2..4 were never drafted and
    have no acceptance (left out, not null); one token is '1 token', and an unmeasured share of
    other processes is not printed as None."""
    base = ["generate", "--model", str(tiny_checkpoint), "--prompt", "def f(x):", "--draft", "draft-model",
            "--draft-model", str(tiny_checkpoint), "-k", "4"]
    code, out, err = run_cli(capsys, *base, "--max-new-tokens", "2", "--json")
    stats = json.loads(out)["stats"]
    assert code == 0, err
    assert stats["reached_per_position"] == [1, 0, 0, 0] and stats["acceptance_per_position"] == [1.0]
    assert None not in stats["proposal_rate_per_position"]
    code, out, err = run_cli(capsys, *base, "--max-new-tokens", "1")
    assert code == 0 and "--- 1 token in " in err and "None" not in err and " 1 threads" not in err
