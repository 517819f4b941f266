"""`specdec bench` end to end on tiny random models (fp32, so greedy speculative decoding is
exactly plain decoding): the JSON schema, the conditions on every result, the lossless check,
the cost-model fields, the batch effect, the MoE check, the report and the plots. Timings are
recorded, never asserted."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from specdec.bench.plots import PLOTS
from specdec.bench.report import JSON_NAME, REPORT_NAME, cell_table, console_report, write_report
from specdec.bench.runner import (SCHEMA, Cell, Config, Plan, acceptance_agreement, check_plan, lossless,
                                  quick_plan, run_bench)
from specdec.bench.verify_cost import MoESpec
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.proposers import DRAFTERS
from specdec.lm.checkpoint import PARALLEL_KIND, WEIGHTS, save_model, sha256
from specdec.heads.block import initial_head as initial_block_head
from specdec.heads.block import save_block
from specdec.heads.eagle import initial_head, save_eagle
from specdec.heads.mtp import build_mtp, save_mtp
from specdec.train.objectives import init_weights

from ..conftest import TINY, tiny_model

CFG = dataclasses.replace(TINY, max_position_embeddings=2048)  # HumanEval prompts are long in a 384-token BPE
TINY_MOE = MoESpec(hidden_size=32, expert_intermediate_size=32, num_experts=4, top_k=2, num_layers=1,
                   num_heads=2, num_kv_heads=1, vocab_size=64)
PLAN = Plan((Cell("humaneval", 0.0, 1, (1, 2), 2, peer_k=2, trees=((2,),)),
             Cell("random-chars", 1.0, 1, (2,), 2, auto=False),
             Cell("stdlib-tests", 0.0, 1, (1, 3), 1, auto=False),
             Cell("humaneval", 0.0, 2, (1, 2), 2, auto=False)),
            repeats=2, max_new_tokens=6, moe=TINY_MOE)
CONDITIONS = {"target", "method", "workload", "sampling", "batch_size", "hardware", "software", "repeats",
              "baseline"}


METHODS = ("draft-model", "parallel", "ngram", "mtp", "suffix", "eagle", "block", "self", "hybrid",
           "eagle-hybrid")  # the registry's


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_file):
    root = tmp_path_factory.mktemp("bench")
    save_model(tiny_model(0, CFG), root / "target", tokenizer_file=tokenizer_file, dtype=torch.float32)
    save_model(tiny_model(1, CFG), root / "draft", tokenizer_file=tokenizer_file, dtype=torch.float32)
    torch.manual_seed(2)
    heads = build_mtp("mtp-sequential", CFG, 2)
    init_weights(heads, std=0.1)
    save_mtp(heads, root / "heads", sha256(root / "target" / WEIGHTS), dtype=torch.float32)
    head = initial_head(tiny_model(0, CFG), (0, 1), torch.arange(0, CFG.vocab_size, 2))
    save_eagle(head, root / "eagle", sha256(root / "target" / WEIGHTS), dtype=torch.float32)
    parallel = tiny_model(3, dataclasses.replace(CFG, vocab_size=CFG.vocab_size + 1))  # its mask token: the last id
    save_model(parallel, root / "parallel", tokenizer_file=tokenizer_file, dtype=torch.float32, meta={
        "kind": PARALLEL_KIND, "tokens_seen": 1000, "training_seconds": 60.0,
        "parallel": {"mask_token_id": CFG.vocab_size, "block": 8, "target_sha256": sha256(root / "target" / WEIGHTS)}})
    block = initial_block_head(tiny_model(0, CFG), (0, 1), torch.arange(0, CFG.vocab_size, 2), 2, causal=True)
    save_block(block, root / "block", sha256(root / "target" / WEIGHTS), dtype=torch.float32)
    return root


@pytest.fixture(scope="module")
def result(models):
    # the peers in fp32 too: tiny random models have no rounding ties then, so every check is exact
    paths = {"draft-model": models / "draft", "hybrid": models / "draft", "mtp": models / "heads", "eagle": models / "eagle",
             "eagle-hybrid": models / "eagle", "block": models / "block", "parallel": models / "parallel"}
    return run_bench(PLAN, models / "target", paths, progress=False, peer_dtype=torch.float32)


def test_every_configuration_runs_with_its_conditions(result):
    assert result["schema"] == SCHEMA
    assert [c["batch_size"] for c in result["cells"]] == [1, 1, 1, 2]
    labels = [r["label"] for r in result["cells"][0]["results"]]
    assert labels == ["plain", *(f"{m} {c}" for m in METHODS
                                 for c in ("k=1", "k=2", "tree=2", *(["dynamic=2"] * (m == "draft-model")),
                                           "k=auto")),
                      "hf-generate", "hf-assisted k=2", "hf-prompt-lookup k=2"]
    auto = next(r for r in result["cells"][0]["results"] if r["label"] == "ngram k=auto")
    assert sum(auto["adaptive"]["choices"].values()) == auto["counters"]["steps"]
    # MTP heads of depth 2 and a block head of 2 run only at k <= 2; peers only at batch 1 and where the cell asks
    assert [r["label"] for r in result["cells"][2]["results"]] == ["plain", "draft-model k=1", "draft-model k=3",
                                                                   "parallel k=1", "parallel k=3", "ngram k=1",
                                                                   "ngram k=3", "mtp k=1", "suffix k=1", "suffix k=3",
                                                                   "eagle k=1", "eagle k=3", "block k=1", "self k=1",
                                                                   "self k=3", "hybrid k=1", "hybrid k=3",
                                                                   "eagle-hybrid k=1", "eagle-hybrid k=3"]
    assert not any(r["method"].startswith("hf-") for r in result["cells"][3]["results"])
    for cell in result["cells"]:
        for r in cell["results"]:
            assert set(r["conditions"]) == CONDITIONS
            c = r["conditions"]
            assert c["batch_size"] == cell["batch_size"] and c["method"]["name"]
            assert c["target"]["checkpoint_sha256"] != "unknown" and c["hardware"]["cpu"]
            assert c["workload"]["max_new_tokens"] == PLAN.max_new_tokens
            assert c["sampling"]["temperature"] == cell["sampling"]["temperature"]
            assert r["tokens_per_s"]["n"] == r["speedup"]["n"] == PLAN.repeats
            assert r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
            if r["k"] and not r["method"].startswith("hf-"):
                assert c["method"]["k"] == r["k"]
    json.loads(json.dumps(result))  # plain JSON


def test_lossless_check_in_greedy_cells(result):
    for cell in result["cells"]:
        greedy = cell["sampling"]["temperature"] == 0
        for r in cell["results"]:
            check = r["lossless"]
            assert check["checked"] == greedy
            if greedy:  # fp32 tiny models: every method reproduces its reference exactly
                assert check["identical"] == check["prompts"] == cell["workload"]["prompts"]
                assert check["reference"] == ("hf-generate" if r["method"] in ("hf-assisted", "hf-prompt-lookup")
                                              else "plain")


def test_a_mismatch_is_listed_and_printed():
    plain, bad = Config("plain"), Config("ngram", 2)
    plain.outputs, bad.outputs = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    check = lossless(bad, plain, 0.0)
    assert check == {"checked": True, "reference": "plain", "prompts": 2, "identical": 1,
                     "mismatches": [{"prompt": 1, "first_difference": 1}]}


def test_acceptance_and_cost_model_fields(result):
    for cell in result["cells"]:
        for r in cell["results"]:
            speculative = r["method"] in METHODS
            assert (r["predicted_speedup"] is not None) == speculative
            if speculative:
                depth = r["counters"]["k"]  # "auto": the deepest option
                assert r["k"] == depth or r["k"] == "auto"
                # auto may have decoded plainly all along (no drafts: no α)
                assert (0 <= r["acceptance_rate"] <= 1 if r["counters"]["proposed"] else r["k"] == "auto")
                assert len(r["acceptance_per_position"]) == depth
                assert 1 <= r["mean_acceptance_length"] <= depth + 1
                assert r["prediction_error"] == pytest.approx(r["predicted_speedup"] / r["speedup"]["median"] - 1)
                assert r["counters"]["emitted"] == cell["workload"]["prompts"] * PLAN.max_new_tokens
        curve = cell["verify_curve"]
        assert curve["batch_size"] == cell["batch_size"] and 1 in curve["tokens"]
        assert len(curve["seconds"]) == len(curve["tokens"]) and min(curve["seconds"]) > 0
    effect = {(b["method"], b["k"]): b for b in result["batch_effect"]}
    assert set(effect) == {(m, k) for m in METHODS for k in (1, 2)}
    assert all(list(b["speedup_by_batch"]) == [1, 2] for b in effect.values())


def test_moe_check(result):
    moe = result["moe"]
    assert moe["moe_parameters"]["active"] < moe["moe_parameters"]["total"]
    assert moe["moe_relative"][0] == moe["dense_relative"][0] == 1.0
    assert moe["distinct_experts_estimate"][0] == pytest.approx(TINY_MOE.top_k)
    assert len(moe["moe_seconds"]) == len(moe["dense_seconds"]) == len(moe["tokens"])


def test_report_files_and_printed_table(result, tmp_path):
    out = write_report(result, tmp_path)
    assert json.loads((out / JSON_NAME).read_text())["schema"] == SCHEMA
    for name in PLOTS:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    report = (out / REPORT_NAME).read_text()
    text = console_report(result, out)
    for doc in (report, text):
        assert "conditions: target" in doc and "threads" in doc and "torch" in doc
        for network in ("draft model `", "parallel draft `", "MTP heads `", "EAGLE head `", "block head `"):
            assert doc.count(network) == 1, network  # each network read named once (the hybrids' too)
        assert "temperature 0 (seed 0), batch 2" in doc and "hf-prompt-lookup k=2" in doc
        assert "3/3 vs plain" not in doc and "2/2 vs plain" in doc and "n/a (sampling)" in doc
    assert str(out / REPORT_NAME) in text
    # -k auto against the best fixed configuration, and each tree against the chain of as many drafts
    assert "## Adaptive speculation" in report and "| ngram | " in report
    assert "## Trees vs chains" in report and "draft-model dynamic=2 (vs k=2)" in report
    # the learned drafters side by side (tiny models saved without training metadata: budget unknown, but
    # the parallel draft's, saved with a budget)
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| humaneval | ")]
    assert [row[1] for row in rows] == ["draft-model", "parallel", "mtp", "eagle", "block"]
    assert [row[3] for row in rows] == ["unknown", "0.00M", "unknown", "unknown", "unknown"]


def test_sampling_cells_show_seeded_and_unseeded_acceptance_side_by_side(result, tmp_path):
    """Each method's first fixed-k chain of a sampling cell runs once more without a seed; the
    JSON and the report hold both α and say whether they agree. Greedy cells have no such run."""
    for cell in result["cells"]:
        for r in cell["results"]:
            u = r["unseeded_acceptance"]
            if cell["sampling"]["temperature"] == 0 or r["method"] not in METHODS or r["k"] == "auto":
                assert u is None
                continue
            assert u["proposed"] > 0 and 0 <= u["acceptance_rate"] <= 1 and u["standard_error"] >= 0
            assert u["difference"] == pytest.approx(r["acceptance_rate"] - u["acceptance_rate"])
    report = (write_report(result, tmp_path) / REPORT_NAME).read_text()
    assert "## Seeded vs unseeded acceptance" in report and "| random-chars T=1 B=1 | ngram k=2 | " in report


@pytest.mark.parametrize("seeded, unseeded, agree", [
    ((300, 1000), (310, 1000), True),    # 0.30 vs 0.31: one standard error (0.02) apart
    ((300, 1000), (400, 1000), False),   # 0.30 vs 0.40: five apart
    ((3, 10), (6, 10), True),            # few drafts: a wide error
])
def test_seeded_and_unseeded_acceptance_agree_within_noise(seeded, unseeded, agree):
    assert acceptance_agreement(*seeded, *unseeded)["agree"] is agree


def test_printed_mismatch(result):
    cell = json.loads(json.dumps(result["cells"][0]))
    cell["results"][2]["lossless"].update(identical=1, mismatches=[{"prompt": 1, "first_difference": 4}])
    assert "1/2 vs plain; differ: prompt 1 from token 4" in "\n".join(cell_table(cell))


@pytest.mark.parametrize("change, message", [
    ({"methods": ("medusa",)}, "unknown method 'medusa'"),
    ({"cells": (Cell("humaneval", 0.0, 0, (2,), 4),)}, "batch size must be >= 1"),
    ({"cells": (Cell("humaneval", 0.0, 4, (2,), 2),)}, "raise --prompts"),
    ({"cells": (Cell("gsm8k", 0.0, 1, (2,), 2),)}, "unknown workload 'gsm8k'"),
    ({"cells": (Cell("humaneval", 0.0, 1, (0,), 2),)}, "k must be >= 1"),
    ({"repeats": 0}, "repeats and max_new_tokens must be >= 1"),
])
def test_bad_plans_are_refused(change, message):
    with pytest.raises(SpecdecError, match=message):
        check_plan(dataclasses.replace(PLAN, **change))


def test_mtp_k_beyond_the_heads_is_refused(models, capsys):
    code = main(["bench", "--model", str(models / "target"), "--draft-model", str(models / "draft"),
                 "--heads", str(models / "heads"), "--ks", "3", "--methods", "mtp", "--no-moe"])
    assert code == 2
    assert "MTP heads draft at most 2 tokens per step" in capsys.readouterr().err


def test_conditions_are_measured_not_constants(result):
    h = result["conditions"]["hardware"]
    assert h["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), None)
    if flags is None:
        assert h["cpu_features"] == "unknown"
    else:
        assert set(h["cpu_features"]) <= set(flags) and ("avx2" in h["cpu_features"]) == ("avx2" in flags)
    assert h["accelerator"].startswith("none (") == (not torch.cuda.is_available())
    for cell in result["cells"]:
        for r in cell["results"]:
            assert r["lossless_method"] == r["acceptance"]["lossless"]
            sampled = cell["sampling"]["temperature"] > 0
            if r["method"] in METHODS:
                assert r["acceptance"]["rule"].endswith("rejection_sample" if sampled else "greedy_accept")


def test_noisy_figures_are_marked_in_the_report_and_the_json(result, tmp_path):
    from specdec.bench.noise import implausible_verify_points, result_noise
    assert implausible_verify_points({1: 1.0, 2: 0.23, 3: 1.3}) == [(2, pytest.approx(0.23))]  # simulate's
    assert implausible_verify_points({1: 1.0, 2: 246.9, 3: 1.4}) == [(2, pytest.approx(246.9 / 1.4))]
    assert implausible_verify_points({1: 1.0, 2: 1.27, 4: 1.61}) == []
    quiet = {"median": 1.65, "min": 1.6, "max": 1.7, "n": 3}
    loud = {"median": 1.65, "min": 0.02, "max": 3.05, "n": 3}  # the quick bench
    assert result_noise(quiet, quiet, False, True) == []
    assert "speedup repeats spread 184%" in result_noise(quiet, loud, False, True)[0]
    assert result_noise(quiet, quiet, True, True) == ["the verify-cost curve the prediction uses is implausible"]
    noisy = json.loads(json.dumps(result))
    for c in noisy["cells"]:  # the run's own figures may be noisy on a loaded machine: start from quiet ones
        for r in c["results"]:
            r["noise"] = []
    cell = noisy["cells"][0]
    cell["results"][1]["noise"] = result_noise(quiet, loud, False, True)
    cell["verify_curve"]["implausible"] = [[3, 0.23]]
    out = write_report(noisy, tmp_path)
    report = (out / REPORT_NAME).read_text()
    assert f"{cell['results'][1]['label']}: speedup repeats spread 184%" in report
    assert "NOISY verify-cost curve: t(3) is 0.23x" in report and " NOISY |" in report
    left_out = sum(1 for c in noisy["cells"] for r in c["results"] if r["noise"] and r["prediction_error"] is not None)
    assert left_out == 1 and "; 1 noisy configurations left out" in console_report(noisy, out)
    for c in noisy["cells"]:
        for r in c["results"]:
            r["noise"] = ["speedup repeats spread 184%"]
    spec = sum(1 for c in noisy["cells"] for r in c["results"] if r["prediction_error"] is not None)
    assert f"all {spec} speculative configurations are noisy" in console_report(noisy, out)
    assert all("noise" in r for c in result["cells"] for r in c["results"]) and "noisy" in result["cells"][0]


def test_no_empty_batch_effect_plot(result, tmp_path):
    without = dict(result, batch_effect=[])
    out = write_report(without, tmp_path)
    assert not (out / "speedup_vs_batch.png").exists()
    assert "speedup_vs_batch.png" not in (out / REPORT_NAME).read_text()
    assert (out / "speedup_vs_k.png").exists()


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """A user's own checkpoint: a small random Qwen2 (a transformers config, save_pretrained) with a
    tokenizer of its own, for which none of the shipped drafters was made."""
    from ..lm.test_families import hf_model, save
    from ..lm.test_tokenizer import foreign_checkpoint_tokenizer
    folder = tmp_path_factory.mktemp("own")
    save(hf_model("qwen2", vocab_size=300, max_position_embeddings=4096, bos_token_id=0, eos_token_id=2), folder,
         torch.bfloat16)
    foreign_checkpoint_tokenizer(folder, False, json.loads((folder / "config.json").read_text()))
    return folder


SHIPPED_DRAFTERS = ("draft-model", "parallel", "mtp", "eagle", "block", "hybrid", "eagle-hybrid")


def test_the_quick_plan_on_your_own_model_runs_what_fits_and_names_what_it_skips(own_model, tmp_path, capsys):
    code = main(["bench", "--quick", "--model", str(own_model), "--prompts", "4", "--repeats", "1",
                 "--max-new-tokens", "3", "--no-moe", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    skipped = {line.split()[3].rstrip(":"): line for line in err.splitlines()
               if line.startswith("specdec bench: skipped")}
    assert sorted(skipped) == sorted(SHIPPED_DRAFTERS)  # one line each, with the reason
    # each cell says how long it will take here, from its warm-up, before its timed repeats
    assert len(re.findall(r"specdec bench: .*: about \d+ s more here \(its warm-up", err)) == len(quick_plan().cells)
    assert all("uses another tokenizer than the target" in skipped[name] for name in ("draft-model", "hybrid"))
    assert "was trained for another target" in skipped["parallel"]
    assert all("pass the target" in skipped[name] and "trained for" in skipped[name]
               for name in ("mtp", "eagle", "block", "eagle-hybrid"))
    result = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert sorted(result["skipped"]) == sorted(SHIPPED_DRAFTERS) and (
        result["plan"]["methods"] == ["ngram", "suffix", "self"])
    root = str(Path(__file__).resolve().parents[2])  # the shipped drafters' folders, as a report shows them
    assert all(root not in reason for reason in result["skipped"].values()) and "models/draft" in result["skipped"][
        "draft-model"]
    assert "draft-model" not in result["conditions"]["drafters"]
    first = result["cells"][0]  # the lookup methods, the self-draft and transformers' peers that need no draft model
    assert {r["method"] for r in first["results"]} == {"plain", "ngram", "suffix", "self", "hf-generate",
                                                      "hf-prompt-lookup"}
    for cell in result["cells"]:
        for r in cell["results"]:
            if r["method"] in ("ngram", "suffix") and cell["sampling"]["temperature"] == 0:
                assert r["lossless"]["identical"] == r["lossless"]["prompts"]


def test_the_quick_plan_keeps_the_evidence_in_a_quarter_of_the_tokens():
    """`make run` (issue 34: at most 3 minutes on every machine kind): plain decoding, the drafters and
    transformers' peers on the same greedy prompts (the lossless check), the loss side and sampling,
    repeated 3 times; counted on the default target, where 4 drafters fit and 2 peers run."""
    plan = quick_plan()
    assert any(c.workload == "humaneval" and c.temperature == 0 and c.peer_k for c in plan.cells)
    assert any(c.workload == "random-chars" for c in plan.cells) and any(c.temperature > 0 for c in plan.cells)
    assert plan.repeats == 3

    def generations(cell: Cell) -> int:  # warm-up, counted syncs (specdec only), repeats over the batches
        batches = plan.repeats * -(-cell.prompts // cell.batch_size)
        ours = (1 + 4 * (len(cell.ks) + len(cell.trees) + cell.auto)) * (2 + batches)
        return ours + (2 * (1 + batches) if cell.peer_k and cell.batch_size == 1 else 0)
    tokens = sum(map(generations, plan.cells)) * plan.max_new_tokens
    assert tokens <= 5_000  # the plan before issue 34: 352 generations of 64 tokens, 22,528 tokens (4 min on AVX-512)


def test_methods_named_run_without_the_shipped_draft_and_a_misfit_named_is_refused(own_model, tmp_path, capsys):
    base = ["bench", "--model", str(own_model), "--workloads", "humaneval", "--ks", "2", "--prompts", "1",
            "--repeats", "1", "--max-new-tokens", "3", "--no-moe", "--no-auto"]
    code = main([*base, "--methods", "ngram", "suffix", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    result = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert not any(d.condition(result["conditions"]["drafters"][name]) for name, d in DRAFTERS.items()
                   if name in result["conditions"]["drafters"]) and result["skipped"] == {}
    assert [r["label"] for r in result["cells"][0]["results"]] == ["plain", "ngram k=2", "suffix k=2", "hf-generate",
                                                                  "hf-prompt-lookup k=2"]
    code = main([*base, "--methods", "eagle", "--out", str(tmp_path / "refused")])
    assert code == 2 and "the EAGLE head in" in capsys.readouterr().err


def test_auto_only_runs_plain_and_k_auto_in_every_cell_and_says_the_lowest(models, tmp_path, capsys):
    """`--auto-only`: every cell holds plain decoding and each method at k=auto, nothing else; the
    report gives auto against plain per cell and the lowest of them."""
    out = tmp_path / "auto"
    code = main(["bench", "--model", str(models / "target"), "--draft-model", str(models / "draft"), "--methods",
                 "ngram", "draft-model", "--workloads", "humaneval", "--temperatures", "0", "1", "--batch-sizes", "1",
                 "2", "--prompts", "2", "--max-new-tokens", "4", "--repeats", "1", "--auto-only", "--no-moe", "--out",
                 str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / JSON_NAME).read_text())
    assert len(result["cells"]) == 4
    for cell in result["cells"]:
        assert [r["label"] for r in cell["results"]] == ["plain", "ngram k=auto", "draft-model k=auto"]
    report = (out / REPORT_NAME).read_text()
    assert "| humaneval T=1 B=2 | draft-model | " in report and "k=auto against plain decoding: lowest" in report
    assert not (out / "speedup_vs_k.png").exists()  # no fixed k to plot
    capsys.readouterr()
    assert main(["bench", "--auto-only", "--no-auto", "--workloads", "humaneval"]) == 2
    assert "--auto-only runs each method with -k auto alone" in capsys.readouterr().err



def test_each_repeat_looks_up_in_a_fresh_suffix_trie(models):
    """A repeat of suffix lookup or of the hybrid starts a fresh shared trie: the same prompt decoded
    again would otherwise find its own earlier answer there (memorised, not drafted). The hybrid keeps
    its draft model."""
    from specdec.bench.runner import Bench
    from specdec.decoding.protocol import Outcome
    from specdec.decoding.sampling import Draws, SamplingConfig
    plan = Plan((Cell("humaneval", 0.0, 1, (2,), 2, auto=False),), methods=("suffix", "hybrid"), repeats=1,
                max_new_tokens=4, moe=None)
    bench = Bench(plan, models / "target", {"hybrid": models / "draft"})
    prompt, answer = [5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17]

    def decode(name: str) -> list[int]:
        """A row of `prompt` whose first tokens are 9..13, then the rest of the answer: what lookup drafts
        after them (a match of 5, as long as the hybrid's lookup needs)."""
        proposer = bench.proposers[name]
        lookup = proposer if name == "suffix" else proposer.lookup
        state = lookup.start(24, 3, 1)
        lookup.join(state, [prompt], torch.zeros(1, 2, 1), [SamplingConfig()])
        lookup.observe(state, Outcome([0], [answer[:5]], [5], torch.zeros(1, 5, 1)))
        drafts = lookup.propose(state, torch.tensor([3]), (1, 1, 1), Draws())
        lookup.observe(state, Outcome([0], [answer[5:]], [4], torch.zeros(1, 4, 1)))
        return drafts.tokens[0, :int(drafts.lengths[0])].tolist()

    for name in ("suffix", "hybrid"):
        model = getattr(bench.proposers[name], "model", None)
        assert decode(name) == []                 # the first repeat: nothing to copy
        assert decode(name) == [14, 15, 16]       # the same proposer again: its own earlier answer
        proposer = bench.proposers[name]
        bench.forget(Config(name, 2))
        assert decode(name) == []                 # the next repeat: a fresh trie
        assert getattr(bench.proposers[name], "model", None) is model
        assert bench.proposers[name] is proposer  # the same drafter: what k="auto" learned of it stays
