"""Every script in benchmarks/ runs here on the toy models (the shipped 22M target and its drafters, or
the suite's tiny checkpoints) at tiny sizes: the real runs take SmolLM2, the pair or a llama.cpp build
and minutes; these show each script's code path works and writes what its docs say. A script that
needs what no test machine has (llama.cpp's programs) has its own parts run instead."""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TARGET = ROOT / "models" / "target"


def script(name: str, *args, cwd: Path, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME ARGS...` in `cwd`, importing this checkout's specdec, on one thread (the
    suite runs a test per core); fails the test with its output when it fails."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    run = subprocess.run([sys.executable, str(BENCHMARKS / name), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, cwd=cwd, env=environ)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def last_json(run: subprocess.CompletedProcess) -> dict:
    return json.loads(run.stdout.strip().splitlines()[-1])


def module(name: str):
    """A benchmark script imported as a module (its `main` not run), to call its parts."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), BENCHMARKS / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_serve_head_to_head_drives_specdecs_server_and_writes_its_figures(tmp_path):
    out = tmp_path / "h2h"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_head_to_head.py"), "--model",
                          str(ROOT / "models" / "target"), "--concurrency", "1", "3", "--prompts", "3",
                          "--max-tokens", "8", "--repeats", "1", "--workloads", "humaneval", "--kv-budget", "4096",
                          "--fresh-prompts", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "head-to-head.json").read_text())
    cells = result["cells"]
    assert [(c["server"], c["concurrency"]) for c in cells] == [("specdec plain", 1), ("specdec plain", 3)]
    assert all(c["tokens"] == 3 * 8 and c["failed_requests"] == 0 and c["ttft_p50_s"] > 0 for c in cells)
    # each wave's engine counters: plain decoding's forwards (at least one per token of the longest row), no drafts
    assert all(c["engine"]["specdec_steps_total"] >= 8 and c["engine"]["specdec_proposed_tokens_total"] == 0
               for c in cells)
    assert result["conditions"]["resident_bytes"]["specdec plain"]["peak"] > 0
    assert result["conditions"]["prompts"].startswith("fresh") and result["conditions"]["prompts"].endswith(": 0")
    assert (out / "head-to-head.png").stat().st_size > 0 and "| specdec plain |" in (out / "head-to-head.txt").read_text()


def test_the_head_to_heads_ratios_pair_the_waves():
    """Each ratio is the median of the waves' own ratios, not a ratio of medians: a wave the host slowed
    for both servers moves neither. Wave speeds below: the host halved in wave 2 for everyone."""
    h2h = module("serve_head_to_head.py")

    def cell(server, speeds, level=4):
        return {"server": server, "workload": "chat", "concurrency": level,
                "tokens_per_s": statistics.median(speeds), "repeats_tokens_per_s": speeds}
    cells = [cell("specdec plain", [80, 40, 90]), cell("specdec hybrid", [84, 44, 81]),
             cell("llama-server plain", [30, 15, 31]), cell("llama-server ngram-mod", [33, 14, 32])]
    [row] = h2h.ratios(cells)
    assert row["specdec hybrid / specdec plain"] == pytest.approx(1.05)  # of 1.05, 1.1, 0.9 (medians: 81 / 80)
    assert row["best"] == ["specdec hybrid", "llama-server ngram-mod"]
    assert row["specdec best / llama-server best"] == pytest.approx(84 / 33)  # (medians: 81 / 32)
    alone = h2h.ratios([cell("specdec plain", [80, 40, 90], 1)])
    assert alone == [{"workload": "chat", "concurrency": 1}]


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


def test_seeded_acceptance_compares_gumbel_coupling_with_rejection_sampling(tmp_path):
    result = last_json(script("seeded_acceptance.py", "--prompts", 2, "--max-new", 8, cwd=tmp_path))
    assert set(result["results"]) == {f"{p}, {r}" for p in ("draft-model", "ngram")
                                      for r in ("rejection sampling (no seed)", "Gumbel-max (seed)")}
    for r in result["results"].values():
        assert 0 <= r["alpha"] <= 1 and 1 <= r["tau"] <= 5 and r["steps"] > 0
    assert result["conditions"]["target"] == str(TARGET) and result["conditions"]["prompts"] == "HumanEval 0..1"


def test_structured_validity_runs_the_schema_workload_through_the_api_and_a_server(tmp_path, tiny_checkpoint):
    run = script("structured_validity.py", "--model", tiny_checkpoint, "--tasks", 2, "--max-tokens", 8, cwd=tmp_path)
    result = json.loads(run.stdout)
    assert set(result) == {f"{name}, T={t}" for name in ("plain constrained", "forced + ngram k=6",
                                                         "server, forced + ngram k=6, 4 at once") for t in (0, 1)}
    for r in result.values():
        assert r["tasks"] == 2 and r["valid"] + r["hit_length"] <= 2 and r["validity"] == r["valid"] / 2
    assert 0 < result["forced + ngram k=6, T=0"]["forced_share"] <= 1  # the grammar forced some tokens


def test_self_draft_agreement_scores_every_variant_under_both_rules(tmp_path):
    report = last_json(script("self_draft_agreement.py", "--model", TARGET, "--prompts", 1, "--max-new-tokens", 6,
                              "--noise", 16, cwd=tmp_path))
    assert set(report) == {"humaneval"}  # the 22M target has no chat template: code prompts only
    variants = report["humaneval"]
    assert set(variants) == {"coarse", "fine", "bf16"}
    for v in variants.values():
        assert 0 < v["positions"] <= 6 and 0 < v["seeded"] <= 1 and 0 < v["rejection"] <= 1


def test_self_draft_shared_cache_scores_its_own_cache_against_the_targets(tmp_path):
    report = last_json(script("self_draft_shared_cache.py", "--model", TARGET, "--prompts", 1, "--max-new-tokens", 6,
                              cwd=tmp_path))
    own, shared = report["humaneval"]["own"], report["humaneval"]["shared"]
    assert 0 < own["positions"] == shared["positions"] <= 6
    assert all(0 < r[key] <= 1 for r in (own, shared) for key in ("rejection", "greedy"))


def test_auto_cost_breakdown_splits_plain_and_auto_decoding_into_the_engines_parts(tmp_path):
    run = script("auto_cost_breakdown.py", "humaneval", 0, 1, 1, 1, "ngram,eagle", "--model", TARGET,
                 "--max-new-tokens", 32, cwd=tmp_path)
    result = last_json(run)
    assert set(result) == {"plain", "ngram k=auto", "eagle k=auto"}
    for parts in result.values():
        assert parts["total"] > 0 and parts["plain/this"] > 0
        assert parts["__init__"] > 0 and parts["regroup"] > 0  # the engine's parts were timed
    assert result["plain"]["verify forwards"] == 0 and result["plain"]["plain_step"] > 0
    eagle = result["eagle k=auto"]  # the EAGLE head drafts on this prompt: its verify forwards are counted
    assert eagle["verify forwards"] >= 1 and eagle["tokens"] > eagle["verify forwards"]


def test_step_breakdown_times_each_part_of_a_speculative_step(tmp_path):
    out = tmp_path / "breakdown.json"
    script("step_breakdown.py", "--label", "smoke", "--out", out, "--repeats", 1, "--prompts", 1,
           "--max-new-tokens", 8, cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["label"] == "smoke" and result["t1_ms"] > 0
    assert set(result["configs"]) == {"plain (engine, k=0)", "ngram k=3", "draft-model k=3", "mtp k=1", "mtp k=3"}
    for name, parts in result["configs"].items():
        assert parts["forward"] > 0 and parts["step"] > 0 and parts["tau"] >= 1, name
        assert parts["bookkeeping_over_t1"] > 0
    assert result["configs"]["draft-model k=3"]["propose"] > 0 and result["configs"]["ngram k=3"]["acceptance"] > 0


def test_quant_matrix_speed_times_every_format_and_counts_a_gguf_models_bytes(tmp_path):
    run = script("quant_matrix_speed.py", "--shape", 64, 256, "--rows", 1, 2, "--rounds", 2, "--evict", 1,
                 "--formats", "q8_0,q4_1,q5_0,q4_k,q6_k,q5_0-as-q8_0", cwd=tmp_path)
    lines = run.stdout.strip().splitlines()
    isas = {line.split()[0] for line in lines}
    assert len(lines) == len(isas) * 2 * 6  # every ISA here, both row counts, every format
    assert all(" us " in line and " MB " in line and "x q8_0's time" in line for line in lines)
    from .gguf_helpers import byte_level_tokenizer, hf_model, write_gguf
    gguf = write_gguf(tmp_path / "tiny.gguf", hf_model("llama"), byte_level_tokenizer(), "llama")
    lines = script("quant_matrix_speed.py", "--bytes-of", gguf, cwd=tmp_path).stdout.strip().splitlines()
    assert lines[-1].startswith("all ") and "bytes a weight" in lines[-1]
    assert any(line.startswith("q8_0") for line in lines) and any("(apart)" in line for line in lines)


def test_kernel_efficiency_measures_the_matrix_kernel_in_cache_and_streaming(tmp_path):
    lines = script("kernel_efficiency.py", "--shapes", "64,256", "--rows", 1, 2, "--repeats", 10,
                   cwd=tmp_path).stdout.strip().splitlines()
    assert lines[0].startswith("FMA peak ") and len(lines) == 2
    assert lines[1].startswith("64x256: M=1: ") and "| M=2: " in lines[1] and "GFLOP/s" in lines[1]
    lines = script("kernel_efficiency.py", "streaming", 1, "avx2", "q8_0,q4_k", "--shapes", "64,256", "--evict-mb", 1,
                   cwd=tmp_path).stdout.strip().splitlines()
    assert lines[0].startswith("GB/s of weights, one row, 1 thread(s), avx2")
    rates = {line.split(":")[0]: float(line.split()[-1]) for line in lines[1:]}
    assert set(rates) == {"q8_0", "q4_k"} and all(r > 0 for r in rates.values())


def test_quant_verify_curve_measures_t_of_n_for_a_quantized_target(tmp_path, tiny_checkpoint):
    result = last_json(script("quant_verify_curve.py", "q8_0", "avx2", 2, 1, "--model", tiny_checkpoint,
                              cwd=tmp_path))
    assert result["weights"] == "q8_0" and result["threads"] == 1
    assert all(result[f"new_t{n}_ms"] > 0 and result[f"med_new_t{n}_ms"] > 0 for n in (1, 2, 4, 8))
    assert all(result[f"new_t{n}/t1"] > 0 for n in (2, 4, 8)) and "old_t1_ms" not in result  # no old build given


def test_busy_machine_decodes_quiet_and_beside_a_second_specdec(tmp_path, tiny_checkpoint):
    result = last_json(script("busy_machine.py", "--model", tiny_checkpoint, "--seconds", 0.3, "--policy", "auto",
                              "--competitors", "none,specdec", "--settle", 0, cwd=tmp_path))
    assert result["size"] == str(tiny_checkpoint)
    assert set(result["ratios"]) == {"auto (default)"} and result["ratios"]["auto (default)"]["specdec"] > 0
    assert set(result["tokens_per_s"]) == {"auto (default) | none", "auto (default) | specdec"}


def test_serve_flood_measures_normal_clients_quiet_and_beside_a_flood(tmp_path, tiny_checkpoint):
    result = last_json(script("serve_flood.py", "--model", tiny_checkpoint, "--repeats", 1, "--quiet-seconds", 0.5,
                              "--flood-seconds", 1, "--refusals", 2, cwd=tmp_path))
    assert result["quiet"]["requests"] > 0 and result["flood"]["requests"] > 0  # normal clients were answered
    # two 10 MB bodies refused with a 413 (the script checks each status); the flood's own count depends on how
    # far its niced process gets in a second
    assert result["refusal_of_10MB_s"]["count"] == 2 and len(result["p99_ratio_per_repeat"]) == 1
    assert result["flood_bodies_refused"] >= 0
    assert str(tiny_checkpoint) in result["conditions"]["server"]


def test_pair_chat_answers_writes_a_models_greedy_answers_to_its_requests(tmp_path):
    from .gguf_helpers import byte_level_tokenizer, hf_model, write_gguf
    gguf = write_gguf(tmp_path / "tiny.gguf", hf_model("qwen2"), byte_level_tokenizer(), "qwen2")
    out = tmp_path / "answers.json"
    script("pair_chat_answers.py", gguf, "--new-tokens", 4, "--out", out, cwd=tmp_path)
    written = json.loads(out.read_text())
    prompts = module("pair_chat_answers.py").PROMPTS
    assert written["prompts"] == list(prompts) and len(written["answers"]) == len(prompts)
    assert all(isinstance(a, str) for a in written["answers"]) and str(gguf) in written["made_by"]


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    """Two tiny GGUF files of one tokenizer (random weights, other seeds): a target and its draft."""
    from .gguf_helpers import byte_level_tokenizer, hf_model, write_gguf
    tok = byte_level_tokenizer()
    context = {"max_position_embeddings": 1024}  # room for a HumanEval prompt in bytes
    return (write_gguf(folder / "target.gguf", hf_model("llama", seed=0, **context), tok, "llama"),
            write_gguf(folder / "draft.gguf", hf_model("llama", seed=1, tie_word_embeddings=True, **context), tok,
                       "llama"))


def test_pair_draft_speed_runs_every_draft_variant_against_plain_decoding(tmp_path):
    target, draft = tiny_pair(tmp_path)
    run = script("pair_draft_speed.py", target, "--draft", draft, "--prompts", 1, "--new-tokens", 6, "--rounds", 1,
                 "--variants", "full,vocab,stop,hybrid,stop-requantized", "--requantize", "Q8_0=Q4_0",
                 "--lookup", "ngram,suffix", "-k", 2, cwd=tmp_path)
    rows = {}
    for line in run.stdout.splitlines():
        if line.startswith("| ") and not line.startswith("| decoder"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.setdefault(cells[0], []).append(cells)
    assert set(rows) == {"plain", "draft-model, full", "draft-model, vocab", "draft-model, stop",
                         "draft-model, stop-requantized", "hybrid: suffix, else draft-model, stop", "ngram", "suffix"}
    assert all(len(r) == 2 for r in rows.values())  # humaneval greedy and chat at T=1, seeded
    assert all(cells[-1] == "True" for r in rows.values() for cells in r)  # every output plain decoding's
    assert "one step's forward (least of 15, ms): target " in run.stdout


def test_pair_vs_transformers_runs_specdec_and_transformers_assisted_generation(tmp_path):
    target, draft = tiny_pair(tmp_path)
    out = tmp_path / "pair-transformers.json"
    script("pair_vs_transformers.py", "--target", target, "--draft", draft, "--prompts", 1, "--new-tokens", 4,
           "--draft-max", 2, "--out", out, cwd=tmp_path)
    figures = json.loads(out.read_text())
    decoders = {"specdec plain", "specdec hybrid auto", "transformers generate", "transformers assisted (k=2)"}
    assert set(figures["humaneval tokens_per_s"]) == decoders and all(figures["humaneval tokens_per_s"].values())
    assert figures["identical to its own plain decoding"] == dict.fromkeys(decoders, True)
    assert figures["vs transformers generate"]["transformers generate"] == 1.0


def test_vs_llama_cpp_python_runs_specdecs_side_on_every_form_of_a_gguf(tmp_path):
    target, _ = tiny_pair(tmp_path)
    out = tmp_path / "llamacpp.json"
    run = script("vs_llama_cpp_python.py", "--model", target, "--prompts", 1, "--max-new-tokens", 4, "--repeats", 1,
                 "--methods", "ngram", "eagle", "--out", out, "--without-llama-cpp", cwd=tmp_path)
    result = json.loads(out.read_text())
    forms = ("bf16", "q8_0", "q4_1 (the file, as stored)")
    assert set(result["tokens_per_s"]) == {f"specdec {f} {m}T={t}" for f in forms for t in (0, 1)
                                           for m in ("plain ", "ngram auto ")}
    assert result["greedy_identical_to_plain"] == {f"specdec {f} ngram auto T=0": True for f in forms}
    assert set(result["skipped"]) == {"specdec bf16 eagle"}  # no EAGLE head for this target: named, not hidden
    assert result["conditions"]["llama_cpp_python"] == "not run (--without-llama-cpp)"
    assert "| specdec bf16 plain T=0 |" in run.stdout


def test_vs_llamacpp_native_parts_run_here_and_it_names_the_build_it_needs(tmp_path):
    """The comparison itself needs llama.cpp's programs (llama-bench, llama-speculative-simple,
    llama-lookup, llama-quantize), which no test machine has: its own parts run here, and without a
    build it stops saying what to pass."""
    from specdec import api
    native = module("vs_llamacpp_native.py")
    target = api.load(TARGET)
    speeds = native.rounds({"specdec plain": lambda: native.specdec_decode_speed(target, 4)}, 2)
    assert len(speeds["specdec plain"]["all"]) == 2 and speeds["specdec plain"]["median"] > 0
    figures = {"humaneval tokens_per_s": {"specdec plain": {"median": 30.0, "all": [29.0, 31.0]},
                                          "llama.cpp lookup": {"median": 25.0, "all": [25.0, 25.0]}},
               "acceptance per position": {"specdec hybrid auto": [0.9, 0.8]}, "files": {"target": "t.gguf"}}
    native.plot_pair(figures, tmp_path / "pair.png")
    assert (tmp_path / "pair.png").stat().st_size > 0
    env = {k: v for k, v in os.environ.items() if k != native.llamacpp_native.ENV}
    run = subprocess.run([sys.executable, str(BENCHMARKS / "vs_llamacpp_native.py"), "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0 and "no llama.cpp build named: pass --llama-cpp DIR" in run.stderr
    assert not (tmp_path / "x.json").exists()


def test_cut_draft_vs_eagle_trains_a_cut_of_the_target_and_decodes_with_it(tmp_path):
    """A long-run folder made here (one shard of the target's token ids, held-out answers of every
    group), a one-layer cut of the 22M target trained on it for a few steps, then decoded against
    plain decoding and the target's shipped EAGLE head."""
    import numpy as np
    from specdec.train.longrun import EVAL_KINDS
    rng = np.random.default_rng(0)
    (tmp_path / "pool" / "shards").mkdir(parents=True)
    np.save(tmp_path / "pool" / "shards" / "shard-00000.npy", rng.integers(5, 4000, 4000).astype(np.int32))
    (tmp_path / "pool" / "shards" / "shard-00000.json").write_text("{}")
    (tmp_path / "pool" / "heldout").mkdir()
    rows = [{"kind": kind, "temperature": t, "ids": rng.integers(5, 4000, 40).tolist()} for kind, t in EVAL_KINDS]
    (tmp_path / "pool" / "heldout" / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = last_json(script("cut_draft_vs_eagle.py", "--run", tmp_path / "pool", "--out", tmp_path / "cut",
                              "--model", TARGET, "--layers", 1, "--points", 64, 128, "--batch-size", 2, "--seq-len", 16,
                              "--decode-prompts", 1, "--decode-tokens", 8, "--decode-rounds", 1, cwd=tmp_path))
    assert result["layers"] == 1 and [p["tokens"] for p in result["curve"]] == [0, 64, 128]
    assert all(0 <= g["greedy_alpha_1"] <= 1 for p in result["curve"] for g in p.values() if isinstance(g, dict))
    humaneval = result["decoding"]["humaneval"]
    assert set(humaneval) == {"plain_tokens_per_second", "cut k=1", "cut k=2", "cut k=3", "eagle k=1"}
    assert (tmp_path / "cut" / "model").is_dir() and (tmp_path / "cut" / "cut-draft.json").is_file()


def test_mtp_equal_budget_trains_the_three_objectives_and_measures_their_heads(tmp_path):
    import sysconfig
    evidence = tmp_path / "evidence"
    script("mtp_equal_budget.py", "--out", tmp_path / "runs", "--steps", 4, "--batch-size", 2, "--eval-windows", 4,
           "--test-windows", 4, "--prompts", 1, "--max-new-tokens", 8, "--corpus", Path(sysconfig.get_paths()["stdlib"]) / "json",
           "--step-time", "one", "--evidence", evidence, cwd=tmp_path, timeout=600)
    result = json.loads((evidence / "mtp-experiment.json").read_text())
    assert set(result["runs"]) == {"next-token", "mtp-parallel", "mtp-sequential"}
    assert all(r["config"]["steps"] == 4 and r["valid_next_token_loss"] > 0 for r in result["runs"].values())
    for name in ("mtp-parallel", "mtp-sequential"):  # each head drafts through the engine, greedy and sampled
        acceptance = result["runs"][name]["acceptance"]
        assert {"greedy, k=1", "greedy, k=2", "T=1, greedy drafts, k=2"} <= set(acceptance)
        assert all(0 <= a["alpha"] <= 1 and a["tau"] >= 1 for key, a in acceptance.items() if "k=" in key)
    assert set(result["step_time_and_memory"]) == {"next-token"}
    assert result["step_time_and_memory"]["next-token"]["step_seconds"] > 0
    assert (evidence / "mtp-experiment.png").stat().st_size > 0
    script("mtp_equal_budget.py", "--shipped", "--prompts", 1, "--max-new-tokens", 4, "--evidence", evidence,
           cwd=tmp_path)
    shipped = json.loads((evidence / "mtp-target-heads.json").read_text())
    assert shipped["depth"] == 3 and len(shipped["acceptance"]) == 4 + 6  # its settings and six decoders


def test_every_benchmark_script_has_a_smoke_test_here():
    source = Path(__file__).read_text()
    untested = [p.name for p in sorted(BENCHMARKS.glob("*.py")) if f'"{p.name}"' not in source]
    assert not untested, f"benchmarks without a smoke test in tests/test_benchmarks.py: {untested}"


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
        assert r["runtime_rss_bytes"] < 2 ** 30  # python, torch and the kernels: no parent's peak handed on
        assert r["peak_rss_over_file"] == r["peak_rss_bytes"] / (tmp_path / r["file"]).stat().st_size
        assert r["top1_agreement"]["positions"] == 120
        assert r["read_bandwidth_GBps"]["median"] > 0 and "llama_bench_GBps" not in r
        assert r["specdec_GBps"] == r["specdec_tokens_per_s"]["median"] * r["bytes_per_token"] / 1e9
    assert rows["tiny-F32.gguf"]["not_as_stored"] == [] and rows["tiny-F32.gguf"]["stored_formats"] == "f32"
    assert 0 < rows["tiny-F32.gguf"]["bytes_per_token"] < (tmp_path / "tiny-F32.gguf").stat().st_size
    assert rows["tiny-F32.gguf"]["top1_agreement"]["agreement"] == 1.0
    warned = rows["tiny-mixed.gguf"]["not_as_stored"]
    assert len(warned) == 1 and "F16+Q8_0" in warned[0]
    conditions = result["conditions"]
    assert conditions["threads"] == 1 and conditions["kernels isa"] and conditions["llama.cpp"]["build"] == "not given"
    table = (out / "gguf-formats.md").read_text()
    assert "| tiny-F32.gguf |" in table and "| tiny-mixed.gguf |" in table and "not given" in table
    assert [line.split(":")[0] for line in run.stdout.splitlines()[:2]] == ["tiny-F32.gguf", "tiny-mixed.gguf"]


def test_the_gguf_memory_benchmark_measures_each_stage_against_the_file(tmp_path):
    """A tiny file through api.load and a short decode: every stage's peak and resident memory, the
    runtime's baseline first, the file's size as written."""
    from .gguf_helpers import Q, byte_level_tokenizer, hf_model, write_gguf

    file = write_gguf(tmp_path / "tiny.gguf", hf_model("qwen2"), byte_level_tokenizer(), "qwen2", types=(Q.Q8_0,))
    result = last_json(script("gguf_memory.py", file, "--tokens", 4, cwd=tmp_path))
    assert result["file_bytes"] == file.stat().st_size
    assert list(result["stages"])[0] == "runtime" and {"loaded", "decode"} <= set(result["stages"])
    for stage in result["stages"].values():
        assert stage["VmHWM"] >= stage["VmRSS"] > 0 and stage["RssAnon"] > 0


def test_the_gguf_family_check_compares_a_file_with_transformers_reading_of_it(tmp_path):
    """A tiny float file: specdec's tokenizer, its fp32 run and its run as stored all agree with
    transformers' own GGUF reading of the file, and speculation equals plain decoding."""
    from .gguf_helpers import Q, byte_level_tokenizer, hf_model, write_gguf

    file = write_gguf(tmp_path / "tiny-F32.gguf", hf_model("qwen2"), byte_level_tokenizer(), "qwen2", types=(Q.F32,))
    result = last_json(script("gguf_family_check.py", "--model", file, "--tokens", 6, "--prompt", "def add(a, b):",
                              cwd=tmp_path))
    assert result["agree"]
    assert all(theirs is None for _, theirs in result["config_differences"].values())  # keys transformers leaves unset
    row = result["prompts"][-1]
    assert row["ids_equal"] and row["speculation_equals_plain"]
    assert row["fp32 values"]["equal_prefix"] == row["as stored"]["equal_prefix"] == 6
