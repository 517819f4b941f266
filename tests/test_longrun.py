"""The long run (train/longrun.py) on the shipped toy target (given a chat template) and its shipped
EAGLE-3 head: the prompts' held-out share is fixed by their text and never trained on; the shards
hold the target's own greedy continuations and seeded samples; a run trains, evaluates at its points,
saves, stops, and a second sitting resumes where the first stopped (its step, tokens seen, curve);
the snapshot is a head folder `load_eagle` takes, with its metadata; the held-out greedy α is the
one losses.eagle_metrics computes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from specdec.decoding.costmodel import expected_tokens_iid
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import load_model
from specdec.lm.tokenizer import Tokenizer
from specdec.proposers.eagle_head import load_eagle, read_eagle_meta
from specdec.train import longrun
from specdec.train.longrun import EVAL_KINDS, LongRun, acceptance, curve, encoded, heldout_groups, prompt_seed
from specdec.train.losses import eagle_metrics
from specdec.train.plots import plot_learning_curve
from specdec.train.prompt_pool import HELD_OUT_PERCENT, PoolPrompt, held_out

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
CODE = ["def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"",
        "def first(items):\n    \"\"\"The first item.\"\"\"",
        "def mean(xs):\n    \"\"\"The mean of xs.\"\"\"", "def squares(n):\n    \"\"\"The first n squares.\"\"\""]
CHAT = ["Explain recursion.", "Write a poem about bridges.", "List three facts about the moon.", "What is JSON?"]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("longrun") / "target"
    shutil.copytree(ROOT / "models" / "target", path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>",
                                                            "bos_token": "<|bos|>"}))
    return path


def config(target: Path, *points: int) -> LongRun:
    return LongRun(init=str(ROOT / "models" / "eagle3"), target=str(target), shard_prompts=4, capacity=3,
                   max_new_tokens=24, quantize=None, passes=1.0, seq_len=32, batch_size=2, warmup=2, steps=3,
                   heldout_prompts=2, heldout_new_tokens=40, eval_at=points, save_seconds=0.0)


def write_prompts(out: Path) -> None:
    """A small prompt list in the run folder, as `prompt_file` keeps the pool's."""
    out.mkdir(parents=True, exist_ok=True)
    train = [PoolPrompt(k, t) for pair in zip(CODE, CHAT) for k, t in zip(("code", "chat"), pair)]
    held = [PoolPrompt("code", "def last(items):\n    \"\"\"The last item.\"\"\""),
            PoolPrompt("chat", "What is a map?")]
    (out / "prompts.json").write_text(json.dumps({"seed": 0, "train": [p.__dict__ for p in train],
                                                  "heldout": [p.__dict__ for p in held]}))


def test_the_held_out_share_is_fixed_by_the_text():
    texts = [f"request number {i}" for i in range(20_000)]
    picked = [t for t in texts if held_out("chat", t)]
    assert abs(len(picked) / len(texts) - HELD_OUT_PERCENT / 100) < 0.004
    assert picked == [t for t in texts if held_out("chat", t)]  # the same every time
    assert [held_out("code", t) for t in texts[:2000]] != [held_out("chat", t) for t in texts[:2000]]  # kind counts
    assert PoolPrompt("chat", picked[0]).held_out and not PoolPrompt("chat", next(
        t for t in texts if t not in picked)).held_out


def test_a_run_trains_resumes_and_snapshots(chat_target, tmp_path):
    out = tmp_path / "run"
    write_prompts(out)
    # 1_000_000 lies behind the init head (1_024_000 tokens seen): the starting point stands for it
    first = longrun.run(out, config(chat_target, 1_000_000, 1_024_300), log=lambda line: None)
    assert first.tokens_seen >= 1_024_300 and first.init_tokens == 1_024_000
    assert first.step == (first.tokens_seen - first.init_tokens) // 64
    points = curve(out)
    assert [p["tokens_seen"] for p in points] == [1_024_000, first.tokens_seen]  # the start, then the last point
    assert set(points[0]["groups"]) == {f"{k} T={t:g}" for k, t in EVAL_KINDS}
    shards = sorted((out / "shards").glob("shard-*.json"))
    assert shards and (out / "state" / "state.json").exists()

    # the shards hold the target's own answers: greedy ones as the reference decoder's, sampled ones seeded
    model, tokenizer = load_model(chat_target, dtype=torch.float32), Tokenizer.load(chat_target)
    rows = [json.loads(line) for line in (out / "shards" / "shard-00000.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["temperature"]) for r in rows[:4]] == [("code", 0.0), ("code", 0.8), ("chat", 0.0),
                                                                 ("chat", 0.8)]
    for r in rows[:4]:
        prompt = PoolPrompt(r["kind"], r["prompt"])
        e = encoded(tokenizer, prompt)
        rule = StopRule(24, tokenizer.eos_ids, e.stop, tokenizer.decode)
        seed = prompt_seed(0, prompt) if r["temperature"] else None
        want = reference_generate(model, e.ids, rule, SamplingConfig(r["temperature"], seed=seed))
        assert r["ids"] == [*e.ids, *want.tokens]

    # a second sitting resumes: its steps continue, the curve grows by the new points only
    second = longrun.run(out, config(chat_target, 1_024_300, 1_024_600), log=lambda line: None)
    assert second.step > first.step and second.seconds > first.seconds
    assert [p["tokens_seen"] for p in curve(out)][:2] == [1_024_000, first.tokens_seen]
    assert curve(out)[-1]["step"] == second.step

    with pytest.raises(SpecdecError, match="other held-out settings"):  # one held-out set per curve
        longrun.run(out, dataclasses.replace(config(chat_target, 1_024_600), heldout_prompts=1), log=lambda line: None)

    points = longrun.whole_curve({}, curve(out))  # the docs' table and plot
    text = longrun.table(points)
    assert text.count("\n") == 1 + len(curve(out)) and "| 1.02M | " in text
    plot_learning_curve(points, tmp_path / "curve.png", "test", longrun.break_even())
    assert (tmp_path / "curve.png").stat().st_size > 10_000

    dest = longrun.snapshot(out, tmp_path / "heads", config(chat_target, 1_024_300, 1_024_600), "test")
    meta = read_eagle_meta(dest)
    assert (meta["tokens_seen"], meta["steps"], meta["heldout"]["latest"]["step"]) == (
        second.tokens_seen, second.step, second.step)
    head = load_eagle(dest, chat_target)
    assert head.token_counts.sum() > 0 and meta["data"]["shards"] == len(list((out / "shards").glob("*.json")))
    assert [p["tokens_seen"] for p in meta["curve"]] == [p["tokens_seen"] for p in curve(out)]  # the init has none

    # a run from the snapshot in a new folder goes on with the prompts after the ones its head was trained on
    following = tmp_path / "following"
    write_prompts(following)
    pool_file = json.loads((following / "prompts.json").read_text())
    pool_file["train"].append({"kind": "chat", "text": "Name a colour."})  # 9 prompts: 4 * shards % 9 != 0
    (following / "prompts.json").write_text(json.dumps(pool_file))
    third = longrun.run(following, dataclasses.replace(config(chat_target, second.tokens_seen + 64), init=str(dest)),
                        log=lambda line: None)
    assert 0 < third.first_shard == meta["data"]["next_shard"] == meta["data"]["shards"] < 9
    train = json.loads((following / "prompts.json").read_text())["train"]
    rows = [json.loads(line) for line in (following / "shards" / "shard-00000.jsonl").read_text().splitlines()]
    start = third.first_shard * 4 % len(train)
    assert [r["prompt"] for r in rows[::2]] == [p["text"] for p in (train + train)[start:start + 4]] != [
        p["text"] for p in train[:4]]
    # the curve goes on from the snapshot's: its points before this run's start, then this run's
    whole = [p["tokens_seen"] for p in longrun.whole_curve(read_eagle_meta(dest), curve(following))]
    assert whole == [p["tokens_seen"] for p in meta["curve"]][:-1] + [p["tokens_seen"] for p in curve(following)]
    assert whole == sorted(set(whole)) and whole[0] == 1_024_000 and whole[-1] == third.tokens_seen


def test_sigterm_stops_after_the_step_under_way_with_the_state_saved(chat_target, tmp_path):
    out = tmp_path / "run"
    write_prompts(out)

    def log(line: str) -> None:  # the signal arrives while step 10 is logged
        if line.startswith("step 10:"):
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    stopped = longrun.run(out, config(chat_target, 2_000_000), log=log)
    assert stopped.step == 10
    saved = json.loads((out / "state" / "state.json").read_text())["progress"]
    assert (saved["step"], saved["tokens_seen"]) == (10, 1_024_000 + 10 * 64)
    assert signal.getsignal(signal.SIGTERM) == before  # the handler given back


def test_break_even_alpha_is_the_cost_models():
    # at the break-even α, E(α, k) equals the cost of a step in target forwards: k draft steps and the verify
    for name, alpha in longrun.break_even(0.1, {2: 1.05, 5: 1.2}).items():
        k = int(name[2:])
        assert expected_tokens_iid(alpha, k) == pytest.approx(k * 0.1 + {1: 1.05, 4: 1.2}[k])


def test_heldout_greedy_alpha_is_eagle_metrics_alpha(chat_target, tmp_path):
    cfg = config(chat_target, 1_024_300)
    model, tokenizer = load_model(chat_target, dtype=torch.float32), Tokenizer.load(chat_target)
    head = load_eagle(ROOT / "models" / "eagle3", chat_target, dtype=torch.float32)
    prompts = [PoolPrompt("code", CODE[0]), PoolPrompt("code", CODE[1])]
    rows, _ = longrun.answer_all(model, tokenizer, prompts, (0.0,), cfg, 80)
    group = heldout_groups(model, head, rows, cfg, tokenizer.eos_id)[2]  # "code T=0"
    got = acceptance(model, head, group, cfg.steps)
    hits, reached = torch.zeros(cfg.steps), torch.zeros(cfg.steps)
    for batch, _, _ in group.batches:
        figures = eagle_metrics(model, head, batch, cfg.steps)
        alphas, counts = torch.tensor(figures[cfg.steps:2 * cfg.steps]), torch.tensor(figures[2 * cfg.steps:])
        hits, reached = hits + alphas * counts, reached + counts
    assert got["greedy_reached"] == reached.long().tolist()
    assert got["greedy_alpha"] == pytest.approx((hits / reached.clamp(min=1)).tolist())
    assert all(0 <= a <= 1 for a in got["t1_alpha"]) and got["t1_positions"][0] > 0
