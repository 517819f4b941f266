"""The scripts in benchmarks/ run end to end on the toy target (the real runs take the pair and a
llama.cpp build; these show the scripts work and write what their docs say)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_serve_head_to_head_drives_specdecs_server_and_writes_its_figures(tmp_path):
    out = tmp_path / "h2h"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_head_to_head.py"), "--model",
                          str(ROOT / "models" / "target"), "--concurrency", "1", "3", "--prompts", "3",
                          "--max-tokens", "8", "--repeats", "1", "--workloads", "humaneval", "--kv-budget", "4096",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "head-to-head.json").read_text())
    cells = result["cells"]
    assert [(c["server"], c["concurrency"]) for c in cells] == [("specdec plain", 1), ("specdec plain", 3)]
    assert all(c["tokens"] == 3 * 8 and c["failed_requests"] == 0 and c["ttft_p50_s"] > 0 for c in cells)
    assert result["conditions"]["resident_bytes"]["specdec plain"]["peak"] > 0
    assert (out / "head-to-head.png").stat().st_size > 0 and "| specdec plain |" in (out / "head-to-head.txt").read_text()


def test_the_serve_soak_answers_everything_and_reports_memory(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_soak.py"), "--minutes", "0.3",
                          "--clients", "6", "--max-tokens", "24", "--workloads", "humaneval", "--",
                          "--model", str(ROOT / "models" / "target")], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["answered"] > 6 and summary.get("failed", 0) == 0 and summary["healthy_after"]
    assert summary["abandoned"] >= 1  # clients did hang up mid-answer
    assert summary["resident_gib"]["highest"] > 0


def test_the_shared_prefix_bench_times_a_first_request_and_its_repeats(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_shared_prefix.py"), "--tokens", "200",
                          "--rounds", "1", "--repeats", "2", "--", "--model", str(ROOT / "models" / "target")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(summary["first_s"]) == 1 and len(summary["repeat_s"]) == 2 and summary["prompt_tokens"][0] > 100
