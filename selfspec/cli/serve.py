"""`selfspec serve MODEL`: an OpenAI-compatible HTTP server (`selfspec.serving`).

    selfspec serve smollm2-135m-instruct
    selfspec serve smollm2-135m-instruct --plan plan.json --port 8080 --api-key "$KEY"

This module parses arguments, loads the model and starts uvicorn; the server
is `selfspec.serving.create_app`. Needs `pip install 'selfspec[serve]'`.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import common

HELP = "serve a model over an OpenAI-compatible HTTP API (chat and completions, streaming)"
EPILOG = (
    "One worker thread owns the model. With --max-batch N > 1 (the default, 8) requests are batched "
    "continuously: at every round boundary waiting requests join while fewer than N run, each round is one "
    "forward pass for all of them (each its own n-gram draft; the measured cost model picks the draft length "
    "per batch), and a finished request leaves at once. --max-batch 1 runs one request at a time with every "
    "plan feature (layer drafts, heads, trees, the static step). A request beyond --max-queue waiting ones gets HTTP 429. Endpoints: POST /v1/chat/completions, "
    "POST /v1/completions, GET /v1/models, /health, /metrics (Prometheus). With --api-key, /v1 requests need "
    "'Authorization: Bearer KEY'; /health and /metrics stay open. Needs: pip install 'selfspec[serve]'."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("model", type=common.text, help="known model name (e.g. smollm2-135m-instruct) or a local "
                                                         "model folder (clients send it as 'model' unless --model-name)")
    parser.add_argument("--model-name", type=common.text, default=None, metavar="NAME",
                        help="the name clients send as 'model' and /v1/models lists (default: MODEL as given)")
    parser.add_argument("--plan", type=common.existing_file,
                        help="a plan JSON file (default: the adapter's plan for this model)")
    parser.add_argument("--host", default="127.0.0.1", type=common.text,
                        help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=common.integer(0, 65535), default=8000, help="port (default: 8000)")
    parser.add_argument("--max-batch", type=common.integer(1), default=8, metavar="N",
                        help="requests that share a round (continuous batching; default: 8); 1: one at a time, "
                             "with every plan feature")
    parser.add_argument("--max-queue", type=common.integer(1), default=64, metavar="N",
                        help="requests that may wait; one more gets HTTP 429 (default: 64)")
    parser.add_argument("--max-request-bytes", type=common.integer(1), default=4 * 1024 * 1024, metavar="N",
                        help="a request body over N bytes gets HTTP 413 (default: 4 MiB, far more text than a "
                             "context holds)")
    parser.add_argument("--shutdown-grace", type=common.number(0), default=5.0, metavar="SECONDS",
                        help="on SIGINT or SIGTERM: new requests get HTTP 503, running ones this long to finish, "
                             "then they are stopped and the server exits (default: 5)")
    parser.add_argument("--api-key", type=common.text, default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1 requests (default: no key)")
    parser.add_argument("--dtype", default="float32", choices=common.DTYPES, help="the model's dtype (default: float32)")
    parser.add_argument("--device", default="cpu", type=common.device, help="torch device (default: cpu)")
    parser.add_argument("--threads", type=common.integer(1), default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--quantize", choices=common.QUANTIZE_CHOICES, default=None,
                        help="quantize the model's linear layers weight-only after loading (torchao)")
    common.add_offload_arguments(parser)
    parser.add_argument("--prefix-cache", type=common.size, default="1GiB", metavar="SIZE",
                        help="keep the KV of finished requests, least recently used out first, so a request that "
                             "starts as an earlier one did (a chat's next turn) prefills only the rest "
                             "(default: 1GiB; 0: off)")
    common.add_step_argument(parser)
    common.add_reproducible_argument(parser)


def run(args: argparse.Namespace) -> int:
    from ..serving import check_dependencies

    check_dependencies()  # before the model loads: one line naming `pip install 'selfspec[serve]'`
    import uvicorn

    import selfspec
    from ..memory import bound_kernel_caches
    from ..serving import create_app

    bound_kernel_caches()  # before any pass: prompts of every length would otherwise each keep their kernels

    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty (valid: a non-empty key)")
    plan = selfspec.DraftPlan.load(args.plan) if args.plan else None
    common.check_step(args.step, args.device)
    common.set_threads(args.threads)
    print(f"selfspec: loading {args.model} ({args.dtype}, {args.device})...", file=sys.stderr, flush=True)
    began = time.perf_counter()
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize,
                                     **common.offload_options(args))
    spec = selfspec.wrap(model, plan=plan, step=args.step, kernels=args.kernels, reproducible=args.reproducible,
                         prefix_cache=args.prefix_cache)
    print(f"selfspec: loaded in {time.perf_counter() - began:.1f} s; plan: {spec.describe_plan()}", file=sys.stderr,
          flush=True)
    name = args.model_name or args.model
    app = create_app(spec, tokenizer, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue,
                     api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    how = "one request at a time" if args.max_batch == 1 else f"continuous batching, up to {args.max_batch} requests"
    print(f"selfspec: serving {name} on http://{args.host}:{args.port}/v1 ({how})",
          file=sys.stderr, flush=True)
    from ..serving.app import GracefulServer

    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"),
                            grace=args.shutdown_grace)
    server.run()
    return 0
