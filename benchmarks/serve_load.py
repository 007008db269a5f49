"""Load on `selfspec serve`: N concurrent streaming clients against three servers of the same model.

    python -m benchmarks.serve_load                                   # concurrency 1,2,4,8; 32 requests each
    python -m benchmarks.serve_load --threads 1 --concurrency 1,2 --requests 2 --max-tokens 16   # a smoke run
    python -m benchmarks.serve_load --multi-turn        # chats over long documents, with and without the prefix cache

Three servers, all on 127.0.0.1 (free ports), in this process (uvicorn in
threads), each serving the one loaded model:

- `selfspec-plan`: `selfspec serve` with the plan (the adapter's, or `--plan`), `--max-batch` = the top concurrency;
- `selfspec-plain`: the same with drafting off (`DraftPlan.plain()`);
- `hf-generate`: the same server, but each request is one `model.generate` call (`GenerateEngine`), max batch 1:
  the baseline.

For each concurrency level C (in order), the level's `--requests` are split
into `--blocks` blocks; in each block every server in turn (the order rotated
by one per block, so drift hits all alike) gets the block's streaming chat
completions (greedy, `max_tokens`, the same prompts for every server) from C
clients that each send the next request when their last one ends; every
request has a timeout and the whole run a time limit. Reports per server and
level: aggregate completion tok/s, requests/s, time to first token, latency
and per-token latency percentiles, the ratio of tok/s to `hf-generate` at the
same level, and whether every output equals `hf-generate`'s for the same
prompt; and per level the plan's tok/s over drafting off's in every block
(on a host whose speed drifts, the blocks' median is the steadier figure).
See benchmarks/README.md.
Writes results/<time>-serve_load-<model>-<dtype>/{serve_load.json, table.md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import socket
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from transformers import StoppingCriteriaList

import selfspec
from benchmarks.run import busy_warning, load_average, print_header
from benchmarks.workload import DEFAULT_DATA, Prompt, build_workload, has_chat_template
from selfspec.costs import cpu_capability, cpu_model
from selfspec.serving.generation import Engine, Job, JobCriteria, JobStreamer, Result

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("selfspec-plan", "selfspec-plain", "hf-generate")
BASELINE = "hf-generate"
MODEL_NAME = "served"  # what the clients send as "model"
WARMUP_TOKENS = 8
DESCRIPTIONS = {
    "selfspec-plan": "selfspec serve, the plan, --max-batch = top concurrency",
    "selfspec-plain": "selfspec serve, drafting off (DraftPlan.plain()), --max-batch = top concurrency",
    "hf-generate": "the same server, one model.generate call per request, max batch 1 (the baseline)",
}


# --------------------------------------------------------------------------- the baseline's engine


class GenerateEngine(Engine):
    """Runs each job as one `model.generate` call (Hugging Face's own loop) in place of `spec.generate`.

    The same streamer and stopping criterion as `Engine` (stop strings,
    cancellation, streamed deltas), so the server around it is unchanged. It
    is for a server with max batch 1, which calls `run` for one job at a time;
    it refuses a batch session.
    """

    def session(self, max_rows: int):
        raise RuntimeError("GenerateEngine runs one request at a time: serve it with max_batch=1")

    def run(self, job: Job) -> Result:
        criteria = JobCriteria(job, self.tokenizer)
        streamer = JobStreamer(job, self.tokenizer, criteria)
        options = self.options(job)
        generator = options.pop("generator", None)
        if generator is not None:  # model.generate takes no generator: the global seed does it
            torch.manual_seed(job.seed)
        model = self.spec.model
        input_ids = torch.tensor([job.prompt], dtype=torch.long, device=self.device)
        pad = model.generation_config.pad_token_id
        if pad is None and self.eos:
            pad = min(self.eos)
        with torch.no_grad():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), pad_token_id=pad,
                                    stopping_criteria=StoppingCriteriaList([criteria]), streamer=streamer, **options)
        new = output[0, len(job.prompt):].tolist()
        return self.result(job, new, PlainStats(verify_passes=len(new)), streamer)


@dataclass
class PlainStats:
    """What `model.generate` reports in `Result`'s terms: no drafts, one token per pass."""

    verify_passes: int
    drafted: int = 0
    accepted: int = 0
    tokens_per_pass: float = 1.0
    cached_tokens: int = 0  # no prefix cache

    def by_source(self) -> dict[str, tuple[int, int]]:
        """No draft source drafted anything."""
        return {}


# --------------------------------------------------------------------------- arithmetic (pure)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def per_token_latency(latency: float | None, first_token: float | None, tokens: int) -> float | None:
    """Seconds per token after the first: (latency - time to first token) / (tokens - 1); None under 2 tokens."""
    if latency is None or first_token is None or tokens < 2:
        return None
    return (latency - first_token) / (tokens - 1)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class RequestResult:
    """One request of one level on one server, as its client saw it (times in seconds)."""

    config: str
    concurrency: int
    index: int  # which request of the level: prompt `index % len(prompts)`
    prompt_id: str
    category: str
    sent: float = 0.0  # since the level began
    first_token: float | None = None  # since sent, at the first non-empty text
    latency: float | None = None  # since sent, at the end of the stream
    completion_tokens: int = 0
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0
    text: str = ""
    error: str | None = None
    identical: bool | None = None  # text equal to the baseline's for the same prompt


def summarize_level(results: list[RequestResult], wall_seconds: float) -> dict:
    """The numbers of one server at one concurrency level; failed requests count only as errors."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.first_token for r in ok if r.first_token is not None]
    latency = [r.latency for r in ok if r.latency is not None]
    per_token = [t for t in (per_token_latency(r.latency, r.first_token, r.completion_tokens) for r in ok)
                 if t is not None]
    drafted = sum(r.drafted for r in ok)
    compared = [r for r in ok if r.identical is not None]
    return {
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "completion_tokens": tokens,
        "wall_seconds": wall_seconds,
        "tokens_per_second": ratio(tokens, wall_seconds),
        "requests_per_second": ratio(len(ok), wall_seconds),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "latency_p50": percentile(latency, 50),
        "latency_p99": percentile(latency, 99),
        "per_token_p50": percentile(per_token, 50),
        "acceptance_rate": ratio(sum(r.accepted for r in ok), drafted),
        "identical": sum(1 for r in compared if r.identical),
        "compared": len(compared),
    }


def add_ratios(levels: dict[str, dict[int, dict]], baseline: str) -> None:
    """`vs_baseline` on every level: its tok/s / the baseline server's tok/s at the same concurrency."""
    for per_level in levels.values():
        for concurrency, stats in per_level.items():
            base = levels.get(baseline, {}).get(concurrency, {}).get("tokens_per_second")
            stats["vs_baseline"] = ratio(stats["tokens_per_second"], base)


def compare_outputs(results: list[RequestResult], baseline: str) -> dict:
    """Set `identical` on every finished request: its text equals the baseline's first finished text for the prompt.

    The baseline's reference is its output at the lowest concurrency that
    finished the prompt (one request at a time, so the same at every level).
    Returns the counts: identical, compared, and prompts without a reference.
    """
    reference: dict[str, str] = {}
    for r in sorted(results, key=lambda r: (r.concurrency, r.index)):
        if r.config == baseline and r.error is None:
            reference.setdefault(r.prompt_id, r.text)
    identical = compared = unchecked = 0
    for r in results:
        if r.error is not None:
            continue
        if r.prompt_id not in reference:
            unchecked += 1
            continue
        r.identical = r.text == reference[r.prompt_id]
        compared += 1
        identical += r.identical
    return {"identical": identical, "compared": compared, "without_reference": unchecked}


def interleave(prompts: list[Prompt]) -> list[Prompt]:
    """Categories round-robin (one of each in turn), so any prefix of the list is varied."""
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    queues = list(groups.values())
    ordered: list[Prompt] = []
    for i in range(max((len(q) for q in queues), default=0)):
        ordered += [q[i] for q in queues if i < len(q)]
    return ordered


def block_sizes(requests: int, blocks: int) -> list[tuple[int, int]]:
    """(first request, count) of each block: `requests` split into at most `blocks` nearly equal parts."""
    blocks = max(1, min(blocks, requests))
    edges = [round(i * requests / blocks) for i in range(blocks + 1)]
    return [(a, b - a) for a, b in zip(edges, edges[1:]) if b > a]


def parse_levels(text: str) -> list[int]:
    """`"1,2,4,8"` as [1, 2, 4, 8]: positive integers, in the order given, without repeats."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency takes a comma list of positive integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels) or len(set(levels)) != len(levels):
        raise ValueError(f"--concurrency takes a comma list of distinct positive integers, got {text!r}")
    return levels


# --------------------------------------------------------------------------- servers


@contextlib.contextmanager
def serving(app, *, start_timeout: float = 60.0):
    """uvicorn serving `app` on a free port of 127.0.0.1, in a daemon thread; yields the base URL, then stops it."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), name="serve-load-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        if not server.started:
            raise RuntimeError("the server did not start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def build_apps(model, tokenizer, *, plan, max_concurrency: int, max_queue: int) -> dict:
    """The three apps of `CONFIGS`, on the one model."""
    from selfspec.serving import create_app

    plan_spec = selfspec.wrap(model, plan=plan)
    plain_spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
    return {
        "selfspec-plan": create_app(plan_spec, tokenizer, model_name=MODEL_NAME, max_batch=max_concurrency,
                                    max_queue=max_queue),
        "selfspec-plain": create_app(plain_spec, tokenizer, model_name=MODEL_NAME, max_batch=max_concurrency,
                                     max_queue=max_queue),
        "hf-generate": create_app(plain_spec, tokenizer, model_name=MODEL_NAME, max_batch=1, max_queue=max_queue,
                                  engine=GenerateEngine),
    }


# --------------------------------------------------------------------------- clients


async def send(client, url: str, prompt: Prompt, *, chat: bool, max_tokens: int, result: RequestResult) -> None:
    """One streaming request; fills `result` (times since it was sent) or raises."""
    body: dict = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    sent = time.perf_counter()
    parts: list[str] = []
    async with client.stream("POST", f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:200]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error'].get('message')}")
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    if result.first_token is None:
                        result.first_token = time.perf_counter() - sent
                    parts.append(text)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
                    stats = chunk.get("selfspec") or {}
                    result.drafted, result.accepted = stats.get("drafted", 0), stats.get("accepted", 0)
    result.latency = time.perf_counter() - sent
    result.text = "".join(parts)
    if result.finish_reason is None:
        raise RuntimeError("the stream ended without a finish_reason")


async def run_level(url: str, config: str, prompts: list[Prompt], *, concurrency: int, requests: int, chat: bool,
                    max_tokens: int, request_timeout: float, time_left: float,
                    first: int = 0) -> tuple[list[RequestResult], float]:
    """`requests` requests from `concurrency` clients (each sends its next when its last ends); (results, wall s).

    Request i (counted from `first`) sends `prompts[i % len(prompts)]`.

    Every request is bounded by `request_timeout`, the level by `time_left`:
    what has not finished by then is cancelled (its client disconnects, which
    cancels it on the server) and recorded as an error.
    """
    import httpx

    results = [RequestResult(config, concurrency, i, prompts[i % len(prompts)].prompt_id,
                             prompts[i % len(prompts)].category) for i in range(first, first + requests)]
    pending = iter(results)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout), limits=limits) as client:
        began = time.perf_counter()

        async def client_loop() -> None:
            for result in pending:
                result.sent = time.perf_counter() - began
                try:
                    await asyncio.wait_for(send(client, url, prompts[result.index % len(prompts)], chat=chat,
                                                max_tokens=max_tokens, result=result), request_timeout)
                except asyncio.TimeoutError:
                    result.error = f"timed out after {request_timeout:g} s"
                except asyncio.CancelledError:
                    result.error = "cancelled: the run's time limit"
                    raise
                except Exception as error:  # recorded; the level goes on
                    result.error = f"{type(error).__name__}: {error}"

        tasks = [asyncio.ensure_future(client_loop()) for _ in range(min(concurrency, requests))]
        done, running = await asyncio.wait(tasks, timeout=max(0.0, time_left))
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        wall = time.perf_counter() - began
    for result in results:
        if result.error is None and result.latency is None:
            result.error = "not run: the run's time limit"
    return results, wall


# --------------------------------------------------------------------------- the benchmark


def benchmark(model, tokenizer, prompts: list[Prompt], *, levels: list[int], requests: int, max_tokens: int,
              plan=None, chat: bool = True, request_timeout: float = 300.0, time_limit: float = 3600.0,
              blocks: int = 1, log=print) -> dict:
    """Serve `model` three ways (`CONFIGS`) and load each with every concurrency level; the results as a dict.

    `plan`: the plan of `selfspec-plan` (None: the adapter's). `blocks`: each
    level's requests in that many blocks, every server running each block in
    turn. Keys: `levels` ({config: {concurrency: stats}}), `outputs` (the
    comparison's counts), `plan_vs_plain` ({concurrency: the plan's tok/s over
    drafting off's per block, and their median}), `warm_up` (seconds per
    config), `requests` (every `RequestResult`, as dicts), `time_limit_hit`.
    """
    deadline = time.monotonic() + time_limit
    apps = build_apps(model, tokenizer, plan=plan, max_concurrency=max(levels), max_queue=max(64, max(levels)))
    all_results: list[RequestResult] = []
    walls: dict[tuple[str, int], float] = {}
    block_rates: dict[tuple[str, int], list[float | None]] = {}
    warm_up: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serving(app)) for name, app in apps.items()}
        for name, url in urls.items():  # one short request each: cost measurement, first-call set-up
            results, wall = asyncio.run(run_level(
                url, name, prompts[:1], concurrency=1, requests=1, chat=chat, max_tokens=WARMUP_TOKENS,
                request_timeout=request_timeout, time_left=deadline - time.monotonic()))
            warm_up[name] = round(wall, 2)
            if results[0].error:
                raise RuntimeError(f"warm-up of {name} failed: {results[0].error}")
            log(f"warm-up {name}: ok ({wall:.1f} s)")
        step = 0
        for concurrency in levels:
            for first, size in block_sizes(requests, blocks):
                shift = step % len(CONFIGS)
                step += 1
                for name in CONFIGS[shift:] + CONFIGS[:shift]:
                    left = deadline - time.monotonic()
                    results, wall = asyncio.run(run_level(
                        urls[name], name, prompts, concurrency=concurrency, requests=size, chat=chat,
                        max_tokens=max_tokens, request_timeout=request_timeout, time_left=left, first=first))
                    all_results += results
                    walls[name, concurrency] = walls.get((name, concurrency), 0.0) + wall
                    s = summarize_level(results, wall)
                    block_rates.setdefault((name, concurrency), []).append(s["tokens_per_second"])
                    log(f"concurrency {concurrency} {name}, requests {first}-{first + size - 1}: "
                        f"{_num(s['tokens_per_second'], '.1f')} tok/s, TTFT p50 {_num(s['ttft_p50'], '.2f')} s, "
                        f"latency p50 {_num(s['latency_p50'], '.2f')} s, {s['errors']} errors ({wall:.1f} s)")
    outputs = compare_outputs(all_results, BASELINE)
    levels_summary = {name: {c: summarize_level([r for r in all_results if r.config == name and r.concurrency == c],
                                                 walls[name, c])
                             for c in levels if (name, c) in walls}
                      for name in CONFIGS}
    add_ratios(levels_summary, BASELINE)
    plan_vs_plain = {}
    for c in levels:
        per_block = [ratio(a, b) for a, b in zip(block_rates.get(("selfspec-plan", c), []),
                                                  block_rates.get(("selfspec-plain", c), []))]
        known = [r for r in per_block if r is not None]
        plan_vs_plain[c] = {"blocks": per_block, "median": statistics.median(known) if known else None}
    return {"levels": levels_summary, "outputs": outputs, "plan_vs_plain": plan_vs_plain, "warm_up_seconds": warm_up,
            "time_limit_hit": any(r.error and "time limit" in r.error for r in all_results),
            "requests": [asdict(r) for r in all_results]}


# --------------------------------------------------------------------------- report


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _ms(value) -> str:
    return "n/a" if value is None else f"{1000 * value:.0f}"


def table_lines(levels: dict[str, dict[int, dict]]) -> list[str]:
    lines = ["| server | concurrency | requests | errors | tok/s | vs hf-generate | req/s | TTFT p50 ms | "
             "TTFT p99 ms | latency p50 s | latency p99 s | per-token p50 ms | acceptance | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, per_level in levels.items():
        for concurrency, s in per_level.items():
            lines.append(
                f"| {name} | {concurrency} | {s['requests']} | {s['errors']} | {_num(s['tokens_per_second'], '.1f')} | "
                f"{_num(s['vs_baseline'], '.2f')}x | {_num(s['requests_per_second'], '.3f')} | {_ms(s['ttft_p50'])} | "
                f"{_ms(s['ttft_p99'])} | {_num(s['latency_p50'], '.2f')} | {_num(s['latency_p99'], '.2f')} | "
                f"{_ms(s['per_token_p50'])} | {_num(s['acceptance_rate'], '.1%')} | {s['identical']}/{s['compared']} |")
    return lines


def markdown(header: dict, result: dict) -> str:
    outputs = result["outputs"]
    lines = ["# selfspec serve under load", ""]
    lines += [f"- **{key}**: {value}" for key, value in header.items()]
    lines += ["", "## Per server and concurrency", ""] + table_lines(result["levels"])
    lines += ["", "## The plan over drafting off, per block", "",
              "| concurrency | per block | median |", "|---:|---|---:|"]
    for c, r in result.get("plan_vs_plain", {}).items():
        lines.append(f"| {c} | {', '.join(_num(x, '.2f') for x in r['blocks'])} | {_num(r['median'], '.2f')}x |")
    lines += ["", f"Outputs: {outputs['identical']}/{outputs['compared']} identical to {BASELINE}'s for the same "
                  f"prompt (text; near-ties not checked)"
              + (f"; {outputs['without_reference']} without a {BASELINE} output to compare" if
                 outputs["without_reference"] else "") + "."]
    lines += ["", "Servers: " + "; ".join(f"`{k}`: {v}" for k, v in DESCRIPTIONS.items()) + "."]
    errors = [r for r in result["requests"] if r["error"]]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {r['config']} at concurrency {r['concurrency']}, request {r['index']} ({r['prompt_id']}): "
                  f"{r['error']}" for r in errors[:50]]
        if len(errors) > 50:
            lines.append(f"- ... and {len(errors) - 50} more")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a selfspec.load name or local path")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                   help="the model's dtype (default bfloat16)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma list of concurrent clients (default 1,2,4,8)")
    p.add_argument("--requests", type=int, default=32, help="requests per server and concurrency level (default 32)")
    p.add_argument("--blocks", type=int, default=2,
                   help="split each level's requests into this many blocks, every server running each in turn "
                        "(default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--plan", type=Path, help="plan JSON for selfspec-plan (default: the adapter's plan)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    p.add_argument("--time-limit", type=float, default=3600.0,
                   help="seconds the whole run may take after loading; the rest is cancelled (default 3600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the question draw (default 0)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"Spec-Bench questions (default {DEFAULT_DATA})")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results", help="results folder (default results/)")
    p.add_argument("--verbose", action="store_true", help="keep transformers' warnings")
    p.add_argument("--multi-turn", action="store_true",
                   help="instead: chats of --turns turns over long documents, served with and without the prefix "
                        "cache (benchmarks/serve_multi_turn.py); --max-tokens per turn")
    p.add_argument("--documents", default="1500,3000", help="--multi-turn: document sizes in tokens (default 1500,3000)")
    p.add_argument("--turns", type=int, default=4, help="--multi-turn: turns per conversation (default 4)")
    args = p.parse_args(argv)
    try:
        args.levels = parse_levels(args.concurrency)
    except ValueError as error:
        p.error(str(error))
    if args.requests < 1 or args.max_tokens < 1 or args.threads < 1 or args.blocks < 1:
        p.error("--requests, --max-tokens, --threads and --blocks must be >= 1")
    return args


def draw_prompts(tokenizer, args, chat: bool) -> tuple[list[Prompt], str]:
    """`--requests` prompts (categories interleaved) from the benchmark workload, and where they came from."""
    probe = build_workload(tokenizer, data_path=args.data, per_category=1, seed=args.seed, use_chat_template=chat)
    per_category = max(1, math.ceil(args.requests / max(1, len(probe.categories))))
    workload = build_workload(tokenizer, data_path=args.data, per_category=per_category, seed=args.seed,
                              use_chat_template=chat)
    prompts = interleave(workload.prompts)[: args.requests]
    source = workload.source + ("; FALLBACK: Spec-Bench file absent" if workload.fallback else "")
    return prompts, f"{len(prompts)} prompts, categories interleaved; {source}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        transformers.logging.set_verbosity_error()
        warnings.filterwarnings("ignore", module="transformers")
    torch.set_num_threads(args.threads)
    from selfspec.serving import check_dependencies

    check_dependencies()
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype)
    chat = has_chat_template(tokenizer)
    prompts, source = draw_prompts(tokenizer, args, chat)
    plan = selfspec.DraftPlan.load(args.plan) if args.plan else None
    layers = model.config.get_text_config().num_hidden_layers
    plan_line = selfspec.wrap(model, plan=plan).describe_plan()
    given = sys.argv[1:] if argv is None else argv
    header = {
        "command": shlex.join([sys.executable, "-m", "benchmarks.serve_load", *given]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.platform()}; {cpu_model()}; {os.cpu_count()} CPUs",
        "cpu capability": cpu_capability(),
        "load average at start": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "selfspec": selfspec.__version__,
        "model": f"{args.model} ({type(model).__name__}, {layers} layers)",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompts": source,
        "prompt format": "chat completions (chat template), first turn" if chat else "completions, raw question text",
        "requests": f"{args.requests} per server and concurrency, in {args.blocks} blocks; streaming, temperature 0, "
                    f"max_tokens {args.max_tokens}; timeout {args.request_timeout:g} s each, {args.time_limit:g} s in all",
        "concurrency": ",".join(map(str, args.levels)),
        "plan": f"{plan_line} ({'from ' + str(args.plan) if args.plan else 'the adapter plan'})",
        "servers": "in this process, uvicorn threads on 127.0.0.1; the clients (asyncio + httpx) share its CPUs",
    }
    busy = busy_warning(torch.device("cpu"))
    if busy:
        header["warning"] = busy
    if args.multi_turn:
        return multi_turn_main(model, tokenizer, args, header, plan)
    print_header(header)
    result = benchmark(model, tokenizer, prompts, levels=args.levels, requests=args.requests,
                       max_tokens=args.max_tokens, plan=plan, chat=chat, request_timeout=args.request_timeout,
                       time_limit=args.time_limit, blocks=args.blocks, log=lambda line: print(line, flush=True))
    header["load average at end"] = load_average()
    if result["time_limit_hit"]:
        hit = f"the run hit --time-limit {args.time_limit:g} s: unfinished requests are errors"
        header["warning"] = f"{header['warning']}; {hit}" if "warning" in header else hit
    table = markdown(header, result)
    folder = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}-serve_load-{Path(str(args.model)).name}-{args.dtype}"
    folder.mkdir(parents=True, exist_ok=True)
    data = {"header": header, "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **result}
    (folder / "serve_load.json").write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    (folder / "table.md").write_text(table, encoding="utf-8")
    print("\n" + table.split("## Per server and concurrency", 1)[1].strip())
    print(f"\nresults in {folder}")
    return 0


def multi_turn_main(model, tokenizer, args, header: dict, plan) -> int:
    """`--multi-turn`: the prefix cache's run (`serve_multi_turn.py`); writes serve_multi_turn.json."""
    from benchmarks.serve_multi_turn import run as run_multi_turn

    for key in ("prompts", "prompt format", "requests", "concurrency"):
        header.pop(key)
    header["conversations"] = (f"documents of {args.documents} tokens, {args.turns} turns each; streaming, "
                               f"temperature 0, max_tokens {args.max_tokens}; servers with --prefix-cache 1GiB and "
                               f"without, each turn to both, alternating which goes first")
    print_header(header)
    results = run_multi_turn(model, tokenizer, plan=plan, documents=[int(d) for d in args.documents.split(",")],
                             turns=args.turns, max_tokens=args.max_tokens, max_batch=max(args.levels),
                             request_timeout=args.request_timeout, data=args.data,
                             log=lambda line: print(line, flush=True))
    folder = args.out / f"{time.strftime('%Y%m%d-%H%M%S')}-serve_multi_turn-{Path(str(args.model)).name}-{args.dtype}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "serve_multi_turn.json").write_text(json.dumps({"header": header, "results": results}, indent=1,
                                                             default=str) + "\n", encoding="utf-8")
    print(f"\nresults in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
