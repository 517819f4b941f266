"""Evidence per GGUF block format: one file requantized by llama.cpp into each format, and for each
file how specdec runs it as stored against llama.cpp on the same file.

    python benchmarks/gguf_formats.py --llama-cpp LLAMA_BUILD --model qwen2.5-coder-1.5b --out OUT
    python benchmarks/gguf_formats.py --llama-cpp LLAMA_BUILD --model SOURCE.gguf --formats Q8_0 Q5_K_M --out OUT
    python benchmarks/gguf_formats.py --files A.gguf B.gguf --out OUT [--llama-cpp LLAMA_BUILD]

--model (a .gguf file or a packaged model's short name) is requantized by `llama-quantize` into each of
--formats (default: every format of FORMATS). A source holding quantized blocks (the packaged Q4_K_M
files) needs `--allow-requantize`, which this passes and says: each format then holds the source's
values rounded again, not the model's original weights (an F16, BF16 or F32 source gives the files
llama.cpp users get). None of these formats needs an importance matrix in llama-quantize (only IQ1_*,
IQ2_*, IQ3_XXS and Q2_K_S do); --imatrix FILE quantizes with one. A format llama-quantize refuses is
skipped, its message printed and recorded. --files measures files as they are (no llama-quantize).

Per file, in --repeats rounds, interleaved: one specdec process loads the file as stored (its default),
decodes --new-tokens greedy tokens after a fixed prompt on --threads threads (decoding only: the
prompt's prefill and first token excluded) and reports its peak resident memory (ru_maxrss) and its
resident memory after decoding; then `llama-bench -p 0 -n NEW_TOKENS -t THREADS` on the same file
(where --llama-cpp is given; else "llama-bench: not given"). Medians of the rounds, their ratio.
Before each round the machine's read bandwidth (summing 1 GiB on --threads threads, in a process of
its own: Linux hands a parent's peak resident memory on to the children it starts, so a parent that had
held the GiB would inflate every later peak):
with the weight bytes one token reads (bench/plain.weight_bytes_per_token of the model as stored, the
same bytes for both), each side's decoding in GB/s and as a share of that bandwidth, the roofline that
no plain decoding of the file passes.
Whether any matrix did not run as stored (specdec's "not as stored" warning, verbatim). And, in one
more process, top-1 agreement under teacher forcing over a fixed text (--text, default the running
interpreter's textwrap.py; its first --text-tokens tokens): specdec's model as stored against the
file's dequantized model (every tensor dequantized by the `gguf` package to float32, run through
specdec's PyTorch operators: no kernels, no block formats).

Writes OUT/gguf-formats.json (conditions: CPU, the kernels' instruction sets, threads, llama.cpp's
build and commit, versions, the machine's load average before and after) and OUT/gguf-formats.md (the
table), after each file, so that a long run keeps what it measured; prints a line per file, the table,
and one JSON line. Figures mean something only on a quiet machine (see the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

from specdec import kernels
from specdec.bench import llamacpp_native
from specdec.bench.conditions import hardware, software
from specdec.bench.plain import measured_read_bandwidth
from specdec.errors import SpecdecError
from specdec.lm import gguf, packaged

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS",
           "F16", "BF16", "F32")  # llama-quantize's names of the formats specdec's kernels run as stored
FLOAT_TYPES = {"F32", "F16", "BF16"}
PROMPT = "def quicksort(items):\n"  # decoding starts after it (the same for every file)
NOT_AS_STORED = "not as stored"  # in specdec's warning for a matrix that runs from a bf16 copy
MiB = 2 ** 20


def llama_cpp_bin(folder: str | None) -> Path | None:
    """llama.cpp's programs' folder: the build folder given, or its bin/; None where none is named."""
    if folder is None and not os.environ.get(llamacpp_native.ENV):
        return None
    folder = Path(folder or os.environ[llamacpp_native.ENV]).expanduser()
    return llamacpp_native.binaries(folder / "bin" if (folder / "bin" / "llama-bench").is_file() else folder)


def tensor_types(path: Path) -> dict[str, int]:
    """How many of the file's tensors each GGML type holds, the most common first."""
    counts: dict[str, int] = {}
    for t in gguf.open_file(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def requantize(bin_dir: Path, source: Path, folder: Path, fmt: str, flags: tuple[str, ...]) -> Path:
    """The source in llama-quantize's format `fmt`, written once into `folder` (reused when there)."""
    if not (bin_dir / "llama-quantize").is_file():
        raise SpecdecError(f"{bin_dir} has no llama-quantize: {llamacpp_native.BUILD_HINT}")
    folder.mkdir(parents=True, exist_ok=True)
    return llamacpp_native.quantize(bin_dir, source, folder / f"{source.stem}-{fmt}.gguf", fmt, flags)


# --- what the child processes do (one file each; they print one JSON line) ---

def rss_bytes() -> int:
    """This process's resident memory now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def decode(file: Path, threads: int, new_tokens: int) -> dict:
    """Load the file as stored, decode greedily after PROMPT once to warm up, then `new_tokens` tokens
    timed: decoding tokens/s, memory, load time and what the load warned."""
    from specdec import api
    from specdec.decoding.engine import plain_generate
    from specdec.decoding.sampling import SamplingConfig
    from specdec.bench.plain import weight_bytes_per_token
    from specdec.decoding.stopping import StopRule
    from specdec.lm.model import stored_formats

    kernels.set_threads(threads)
    kernels.compiled()  # the runtime's own memory (python, torch, the kernels) before the model's
    runtime = peak_rss_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target = api.load(file)
    ids = target.tokenizer.encode(PROMPT)
    plain_generate(target.model, [ids], StopRule(4), SamplingConfig())  # warm-up
    rows, metrics = plain_generate(target.model, [ids], StopRule(new_tokens), SamplingConfig())
    seconds = metrics.total_seconds - metrics.first_token_seconds
    return {"tokens_per_s": (len(rows[0].tokens) - 1) / seconds, "load_s": target.load_seconds,
            "peak_rss_bytes": peak_rss_bytes(), "rss_after_bytes": rss_bytes(), "runtime_rss_bytes": runtime,
            "not_as_stored": [str(w.message) for w in caught if NOT_AS_STORED in str(w.message)],
            "stored_formats": stored_formats(target.model), "prompt_tokens": len(ids),
            "bytes_per_token": weight_bytes_per_token(target.model)}


def dequantized_model(file: Path, reader):
    """The file's model from its values: every tensor dequantized by the `gguf` package to float32,
    held as plain parameters (specdec's PyTorch operators run it: no kernels' matrices)."""
    from specdec.lm.arch import resolve
    from specdec.lm.model import LlamaForCausalLM, place, stored_formats

    config = gguf.config_of(reader, file.name)
    cfg = resolve(config, where=file.name)
    state = {raw.name: gguf.dequantized(raw, torch.float32) for raw in gguf.stored(reader, config)}
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict({name: state[name] for name in model.hf_state_dict()}, assign=True)
    model = place(model, "cpu").eval()
    assert stored_formats(model) == "unstored", "the reference must hold plain float32 parameters"
    return model


def agreement(file: Path, threads: int, text: str, text_tokens: int) -> dict:
    """Top-1 agreement under teacher forcing over the text's first `text_tokens` tokens: specdec's model
    as stored against the file's dequantized model, one forward of the whole text each."""
    from specdec.lm.device import release_freed_memory
    from specdec.lm.gguf_blocks import load_as_stored

    kernels.set_threads(threads)
    reader = gguf.open_file(file)
    ids = torch.tensor([gguf.tokenizer(file, reader).encode(text)[:text_tokens]])  # (1, T)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the decoding process reports the load's warnings
        model = load_as_stored(file, reader=reader)
        as_stored = model(ids).logits[0].argmax(-1)  # (T,)
        del model
        release_freed_memory()
        logits = dequantized_model(file, reader)(ids).logits[0]  # (T, V)
    top2 = logits.topk(2, dim=-1)
    reference, gap = top2.indices[:, 0], top2.values[:, 0] - top2.values[:, 1]
    differ = (as_stored != reference).nonzero().flatten()
    return {"agreement": (as_stored == reference).float().mean().item(), "positions": ids.shape[1],
            "disagreements": len(differ), "widest_reference_gap_at_a_disagreement":
                gap[differ].max().item() if len(differ) else None}


def in_child(args: argparse.Namespace) -> None:
    file = Path(args.child[1])
    if args.child[0] == "decode":
        out = decode(file, args.threads, args.new_tokens)
    elif args.child[0] == "bandwidth":
        torch.set_num_threads(args.threads)
        out = {"bytes_per_s": measured_read_bandwidth(1024)}
    else:
        out = agreement(file, args.threads, text_of(args.text), args.text_tokens)
    print(json.dumps(out))


def child(mode: str, file: Path, args: argparse.Namespace) -> dict:
    """Run `mode` on `file` in a process of its own (its memory its own), with the specdec this script
    imports."""
    import specdec
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(specdec.__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, str(file), "--threads",
               str(args.threads), "--new-tokens", str(args.new_tokens), "--text-tokens", str(args.text_tokens),
               *(["--text", args.text] if args.text else [])]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SpecdecError(f"specdec's {mode} of {file.name} failed (exit status {done.returncode}): "
                           f"{done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the parent: files, rounds, the report ---

def text_of(path: str | None) -> str:
    return Path(path or default_text()).read_text()


def default_text() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def measure(name: str, file: Path, bin_dir: Path | None, args: argparse.Namespace, llama_cpp: dict) -> dict:
    """One file's row: `args.repeats` rounds of specdec's decoding process and llama-bench, interleaved,
    then the agreement."""
    ours, theirs, runs, bandwidth = [], [], [], []
    for _ in range(args.repeats):
        bandwidth.append(child("bandwidth", file, args)["bytes_per_s"])
        runs.append(child("decode", file, args))
        ours.append(runs[-1]["tokens_per_s"])
        if bin_dir is not None:
            bench = llamacpp_native.decode_bench(bin_dir, file, args.threads, args.new_tokens)
            theirs.append(float(bench["avg_ts"]))
            llama_cpp.setdefault("build_commit", bench.get("build_commit", "unknown"))
            llama_cpp.setdefault("build_number", bench.get("build_number", "unknown"))
            llama_cpp.setdefault("cpu_info", bench.get("cpu_info", "unknown"))
            llama_cpp.setdefault("backends", bench.get("backends", "unknown"))
    size = file.stat().st_size
    peak = max(r["peak_rss_bytes"] for r in runs)
    row = {"format": name, "file": file.name, "file_bytes": size, "tensor_types": tensor_types(file),
           "sha256": gguf.file_sha256(file) if args.sha256 else "not computed (--no-sha256)",
           "specdec_tokens_per_s": spread(ours),
           "llama_bench_tokens_per_s": spread(theirs) if theirs else "not given",
           "specdec_over_llama_bench": statistics.median(ours) / statistics.median(theirs) if theirs else None,
           "peak_rss_bytes": peak, "peak_rss_over_file": peak / size,
           "rss_after_decoding_bytes": max(r["rss_after_bytes"] for r in runs),
           "runtime_rss_bytes": min(r["runtime_rss_bytes"] for r in runs),
           "load_s": spread([r["load_s"] for r in runs]),
           "not_as_stored": runs[0]["not_as_stored"], "stored_formats": runs[0]["stored_formats"],
           "prompt_tokens": runs[0]["prompt_tokens"]}
    row["rss_after_decoding_over_file"] = row["rss_after_decoding_bytes"] / size
    row["read_bandwidth_GBps"] = spread([b / 1e9 for b in bandwidth])
    row["bytes_per_token"] = runs[0]["bytes_per_token"]
    for side, rates in (("specdec", ours), ("llama_bench", theirs)):
        if rates:
            row[f"{side}_GBps"] = statistics.median(rates) * row["bytes_per_token"] / 1e9
            row[f"{side}_share_of_bandwidth"] = row[f"{side}_GBps"] / row["read_bandwidth_GBps"]["median"]
    row["top1_agreement"] = child("agree", file, args)
    return row


def progress(row: dict) -> str:
    if "skipped" in row:
        return f"{row['format']}: skipped: {row['skipped']}"
    if "failed" in row:
        return f"{row['format']}: failed: {row['failed']}"
    ours, theirs = row["specdec_tokens_per_s"]["median"], row["llama_bench_tokens_per_s"]
    bench = (f"llama-bench {theirs['median']:.1f} tok/s ({row['specdec_over_llama_bench']:.2f}x)"
             if isinstance(theirs, dict) else "llama-bench: not given")
    a = row["top1_agreement"]
    return (f"{row['format']}: specdec {ours:.1f} tok/s, {bench}; peak RSS {row['peak_rss_bytes'] / MiB:.0f} MiB "
            f"({row['peak_rss_over_file']:.2f}x the file's {row['file_bytes'] / MiB:.0f} MiB); "
            f"{'as stored' if not row['not_as_stored'] else 'NOT as stored'}; top-1 agreement "
            f"{a['agreement']:.4f} ({a['positions'] - a['disagreements']}/{a['positions']})")


def table(rows: list[dict]) -> str:
    lines = ["| format | file MiB | specdec tok/s | llama-bench tok/s | specdec / llama-bench | GB/s read: "
             "specdec / llama-bench / the machine (shares) | peak RSS MiB (x file) | RSS after decoding (x file) | "
             "as stored | top-1 agreement |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "failed" in r:
            lines.append(f"| {r['format']} | {'skipped' if 'skipped' in r else 'failed'}: "
                         f"{(r.get('skipped') or r['failed'])[:200]} ||||||||")
            continue
        theirs, a = r["llama_bench_tokens_per_s"], r["top1_agreement"]
        machine = r["read_bandwidth_GBps"]["median"]
        rates = (f"{r['specdec_GBps']:.1f} ({r['specdec_share_of_bandwidth']:.0%}) / "
                 + (f"{r['llama_bench_GBps']:.1f} ({r['llama_bench_share_of_bandwidth']:.0%})"
                    if "llama_bench_GBps" in r else "-") + f" / {machine:.1f}")
        lines.append(
            f"| {r['format']} | {r['file_bytes'] / MiB:.1f} | {r['specdec_tokens_per_s']['median']:.1f} | "
            + (f"{theirs['median']:.1f} | {r['specdec_over_llama_bench']:.2f}x" if isinstance(theirs, dict)
               else "not given | -") + f" | {rates}"
            + f" | {r['peak_rss_bytes'] / MiB:.0f} ({r['peak_rss_over_file']:.2f}x) | "
            f"{r['rss_after_decoding_over_file']:.2f}x | "
            + ("yes" if not r["not_as_stored"] else "no: " + "; ".join(r["not_as_stored"])[:160])
            + f" | {a['agreement']:.4f} ({a['positions'] - a['disagreements']}/{a['positions']}) |")
    return "\n".join(lines)


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gguf-formats.json").write_text(json.dumps(result, indent=1))
    c = result["conditions"]
    runtime = min((r["runtime_rss_bytes"] for r in result["rows"] if "runtime_rss_bytes" in r), default=0)
    head = [f"# GGUF formats: specdec as stored against llama.cpp ({result['source']['note']})", "",
            f"- CPU: {c['hardware']['cpu']}, {c['threads']} threads; specdec kernels {c['kernels isa']}, "
            f"quantized {c['quant kernels isa']}",
            f"- llama.cpp: {', '.join(f'{k} {v}' for k, v in c['llama.cpp'].items())}",
            f"- decoding: {c['new tokens']} tokens after a {len(PROMPT)}-character prompt, median of "
            f"{c['repeats']} rounds; agreement: the first {c['text tokens']} tokens of {c['text']}",
            f"- resident memory of the runtime alone (python, torch, the kernels; part of every peak): "
            f"{runtime / MiB:.0f} MiB",
            f"- load average (1, 5, 15 min) before / now: {loads(c['load average before'])} / "
            f"{loads(c['load average now'])}", "", ""]
    (out / "gguf-formats.md").write_text("\n".join(head) + table(result["rows"]) + "\n")


def loads(averages: tuple[float, ...]) -> str:
    return ", ".join(f"{a:.2f}" for a in averages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", help="llama.cpp's build folder (or its bin/) with llama-quantize and llama-bench "
                   f"(default ${llamacpp_native.ENV}); without it, --files are measured without llama-bench")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="the GGUF file to requantize (or a packaged short name, e.g. "
                        "qwen2.5-coder-1.5b)")
    source.add_argument("--files", nargs="+", help="GGUF files to measure as they are (no llama-quantize)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), help="llama-quantize's format names")
    p.add_argument("--imatrix", help="an importance matrix file for llama-quantize")
    p.add_argument("--out", help="the folder for the requantized files and the report (required)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--text", help="the text of the agreement (default: the running interpreter's textwrap.py)")
    p.add_argument("--text-tokens", type=int, default=320)
    p.add_argument("--no-sha256", dest="sha256", action="store_false", help="do not hash each file")
    p.add_argument("--drop-files", action="store_true", help="delete each requantized file once it is measured")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return in_child(args)
    if args.out is None:
        p.error("give --out, the folder for the requantized files and the report")
    if not args.model and not args.files:
        p.error("give --model (requantized by llama-quantize) or --files (measured as they are)")
    if args.model and args.llama_cpp is None and not os.environ.get(llamacpp_native.ENV):
        p.error("--model is requantized by llama-quantize: give --llama-cpp (or measure --files as they are)")
    torch.set_num_threads(args.threads)
    bin_dir, out = llama_cpp_bin(args.llama_cpp), Path(args.out)
    flags = ("--imatrix", args.imatrix) if args.imatrix else ()
    if args.model:
        path = Path(packaged.resolve(args.model))
        types = tensor_types(path)
        quantized = sorted(set(types) - FLOAT_TYPES)
        if quantized:
            flags = ("--allow-requantize", *flags)
        note = (f"requantized from {path.name}, whose blocks are {', '.join(quantized)}: lossy, each format holds "
                "those values rounded again, not the model's original weights" if quantized
                else f"quantized from {path.name} ({', '.join(types)})")
        print(f"source: {note}", flush=True)
        todo = [(fmt, lambda fmt=fmt: requantize(bin_dir, path, out / "files", fmt, flags)) for fmt in args.formats]
        source_info = {"file": path.name, "tensor_types": types, "note": note, "llama-quantize flags": list(flags)}
    else:
        todo = [(Path(f).name, lambda f=f: Path(f)) for f in args.files]
        source_info = {"file": None, "note": "files measured as given"}
    llama_cpp = {"build": llamacpp_native.build(bin_dir)} if bin_dir is not None else {"build": "not given"}
    conditions = {"hardware": hardware(), "software": software(), "gguf package": package_version("gguf"),
                  "threads": args.threads, "kernels isa": kernels.isa() or "none",
                  "quant kernels isa": kernels.quant_isa() or "none", "llama.cpp": llama_cpp,
                  "new tokens": args.new_tokens, "repeats": args.repeats, "prompt": PROMPT,
                  "text": args.text or f"the running interpreter's textwrap.py (python {sys.version.split()[0]})",
                  "text tokens": args.text_tokens, "load average before": os.getloadavg()}
    result = {"conditions": conditions, "source": source_info, "rows": []}
    for name, made in todo:
        t0 = time.perf_counter()
        try:
            file = made()
        except llamacpp_native.ProgramFailed as e:
            result["rows"].append({"format": name, "skipped": f"llama-quantize refused it: {e}"})
        else:
            try:
                result["rows"].append(measure(name, file, bin_dir, args, llama_cpp))
            except SpecdecError as e:
                result["rows"].append({"format": name, "file": file.name, "failed": str(e)})
            if args.drop_files and args.model:
                file.unlink()
        conditions["load average now"] = os.getloadavg()
        write(out, result)
        print(f"{progress(result['rows'][-1])} [{time.perf_counter() - t0:.0f} s]", flush=True)
    print(table(result["rows"]))
    print(f"written: {out / 'gguf-formats.json'}, {out / 'gguf-formats.md'}")
    print(json.dumps({r["format"]: {k: r.get(k) for k in ("specdec_over_llama_bench", "peak_rss_over_file",
                                                           "not_as_stored", "skipped", "failed")}
                      | {"agreement": r.get("top1_agreement", {}).get("agreement")} for r in result["rows"]}))


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    try:
        main()
    except SpecdecError as e:  # a setup error (no llama-quantize, no such model): one line, no traceback
        sys.exit(f"error: {e}")
