"""`specdec serve`: the server's flags, checked, handed to the server."""
from __future__ import annotations

import os

from .common import add_draft_arguments, add_target_arguments, add_threads_argument, draft_plan, torch_dtype


def cmd_serve(args) -> None:
    from .. import inputs
    from ..serve.guard import Limits
    from ..serve.lifecycle import Launch, serve

    dtype, kv_dtype = torch_dtype(args.dtype), torch_dtype(args.kv_dtype)
    draft = draft_plan(args)
    inputs.serve(args.max_batch, args.max_queue, args.port, args.max_body_bytes, args.max_connections,
                 args.shutdown_timeout, args.header_timeout, args.body_timeout, args.idle_timeout, args.prefix_cache,
                 args.threads)
    launch = Launch(args.model, draft, dtype, args.device, args.quantize, args.served_model_name, args.host,
                    args.port, args.max_batch, args.max_queue, args.kv_budget, kv_dtype, args.prefix_cache,
                    args.threads, args.shutdown_timeout)
    limits = Limits(max_body=args.max_body_bytes, body_timeout=args.body_timeout, header_timeout=args.header_timeout,
                    idle_timeout=args.idle_timeout, max_connections=args.max_connections,
                    api_key=args.api_key or os.environ.get("SPECDEC_API_KEY") or None,
                    key_for_all=args.api_key_everywhere, cors_origins=tuple(args.cors_origin))
    serve(launch, limits)


def add_serve_parser(sub) -> None:
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding and a live view",
                       description="POST /v1/completions and /v1/chat/completions (OpenAI's formats, streaming "
                                   "with SSE), GET /v1/models, "
                                   "/health, /metrics (Prometheus) and the live view at /. Requests join and leave "
                                   "one running batch between steps (continuous batching).")
    add_target_arguments(v, quantize=True)
    v.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API: /v1/models lists it and requests must name it "
                        "(default: the checkpoint folder's name)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=int, default=8000, help="TCP port")
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
    v.add_argument("--prefix-cache", type=int, metavar="POSITIONS",
                   help="positions of prompt blocks kept after their requests end, so that a later request "
                        "beginning alike is not prefilled again (default 4096, at most a quarter of the KV "
                        "budget; 0: prompts are shared only among requests running together)")
    add_threads_argument(v, "; the HTTP side needs some CPU too")
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

