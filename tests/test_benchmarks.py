"""The scripts in benchmarks/ run end to end on the toy target (the real runs take the pair and a
llama.cpp build; these show the scripts work and write what their docs say)."""
from __future__ import annotations

import json
import os
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


def test_the_gguf_formats_evidence_measures_each_file_as_stored_against_its_dequantized_model(tmp_path):
    """Files measured as given (no llama.cpp build on CI): an F32 file agrees with its own dequantization
    at every position, a file whose fused q/k/v mixes F16 and Q8_0 parts is reported as not run as stored."""
    from .gguf_helpers import Q, byte_level_tokenizer, hf_model, write_gguf

    tok, model = byte_level_tokenizer(), hf_model("qwen2")
    f32 = write_gguf(tmp_path / "tiny-F32.gguf", model, tok, "qwen2", types=(Q.F32,))
    mixed = write_gguf(tmp_path / "tiny-mixed.gguf", model, tok, "qwen2", types=(Q.Q8_0, Q.F16))
    out = tmp_path / "formats"
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_LLAMA_CPP"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gguf_formats.py"), "--files", str(f32),
                          str(mixed), "--out", str(out), "--repeats", "1", "--new-tokens", "8", "--text-tokens", "120",
                          "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "gguf-formats.json").read_text())
    rows = {r["format"]: r for r in result["rows"]}
    assert list(rows) == ["tiny-F32.gguf", "tiny-mixed.gguf"]
    for r in rows.values():
        assert r["llama_bench_tokens_per_s"] == "not given" and r["specdec_over_llama_bench"] is None
        assert r["specdec_tokens_per_s"]["median"] > 0 and r["peak_rss_bytes"] >= r["runtime_rss_bytes"] > 0
        assert r["peak_rss_over_file"] == r["peak_rss_bytes"] / (tmp_path / r["file"]).stat().st_size
        assert r["top1_agreement"]["positions"] == 120
    assert rows["tiny-F32.gguf"]["not_as_stored"] == [] and rows["tiny-F32.gguf"]["stored_formats"] == "f32"
    assert rows["tiny-F32.gguf"]["top1_agreement"]["agreement"] == 1.0
    warned = rows["tiny-mixed.gguf"]["not_as_stored"]
    assert len(warned) == 1 and "F16+Q8_0" in warned[0]
    conditions = result["conditions"]
    assert conditions["threads"] == 1 and conditions["kernels isa"] and conditions["llama.cpp"]["build"] == "not given"
    table = (out / "gguf-formats.md").read_text()
    assert "| tiny-F32.gguf |" in table and "| tiny-mixed.gguf |" in table and "not given" in table
    assert [line.split(":")[0] for line in run.stdout.splitlines()[:2]] == ["tiny-F32.gguf", "tiny-mixed.gguf"]
