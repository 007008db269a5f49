"""Soak `selfspec serve`: many mixed requests from concurrent clients, then the server's memory and gauges at rest.

    python -m benchmarks.soak                                  # 1,000 requests, 8 clients, SmolLM2 bf16
    python -m benchmarks.soak --requests 40 --clients 4        # a smoke run

Starts `selfspec serve` in a process of its own (its RSS read from /proc),
warms it up, then sends `--requests` requests from `--clients` clients, each
sending its next when the last ends. The kinds, drawn with a fixed seed:
streamed and plain greedy chats, completions, streams the client drops after
two chunks, chats without `max_tokens`, seeded samples (a few seeds repeated;
how many gave differing texts is reported, not judged: a seed reproduces its
sample only in the same batch, docs/serving.md), and malformed requests
(which must get a 4xx). At rest it reads the server's gauges (queue, batch,
KV cache) and RSS.

Passes when no response is a 5xx or a broken stream, every malformed request
got a 4xx, the gauges are 0 and RSS at rest is
within `--rss-tolerance` of its level after warm-up. The prefix cache keeps
what it stores on purpose (up to its budget); its bytes are reported and
taken off RSS at rest before the comparison.
Writes results/<time>-soak-<model>/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
import random
import shlex
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch

from benchmarks.workload import DEFAULT_DATA, BUILTIN_PROMPTS
from selfspec.costs import cpu_capability, cpu_model

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
KINDS = {"stream": 20, "chat": 15, "completion": 10, "drop": 15, "no-max-tokens": 10, "seeded": 15, "bad": 15}
SHORT = ("Answer with one word: what colour is the sky on a clear day?", "Reply yes or no: is ice cold?",
         "Name one planet. Just the name.", "What is 2 + 3? Only the number.")
BAD_BODIES = (
    b"{not json", b"", b"[]", json.dumps({"model": "m"}).encode(),
    json.dumps({"messages": "hello"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": 3}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x " * 3_000_000}]}).encode(),  # over the body limit
)


def questions(path: Path) -> list[str]:
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [r["turns"][0] for r in rows]
    return [text for _, text in BUILTIN_PROMPTS]


def plan_requests(count: int, seed: int, pool: list[str]) -> list[tuple[str, dict | bytes]]:
    """`count` (kind, body) pairs: a body is a dict (sent as JSON) or raw bytes (a malformed request)."""
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=count)
    requests = []
    for kind in kinds:
        question = rng.choice(pool)[:2000]
        chat = {"model": "soak", "messages": [{"role": "user", "content": question}], "temperature": 0}
        if kind in ("stream", "chat"):
            body = {**chat, "max_tokens": rng.randint(8, 32), "stream": kind == "stream"}
        elif kind == "completion":
            body = {"model": "soak", "prompt": question, "max_tokens": rng.randint(8, 24), "temperature": 0}
        elif kind == "drop":
            body = {**chat, "max_tokens": 256, "stream": True}
        elif kind == "no-max-tokens":
            body = {**chat, "messages": [{"role": "user", "content": rng.choice(SHORT)}]}
        elif kind == "seeded":
            body = {**chat, "messages": [{"role": "user", "content": pool[rng.randrange(4)]}], "temperature": 0.9,
                    "seed": rng.randrange(4), "max_tokens": 16}
        else:
            body = rng.choice(BAD_BODIES)
        requests.append((kind, body))
    return requests


async def send(client: httpx.AsyncClient, url: str, kind: str, body, timeout: float) -> dict:
    """One request; returns its outcome: status, whether a stream broke, text (for seeded ones), seconds."""
    started = time.perf_counter()
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    outcome = {"kind": kind, "status": None, "broken": False, "text": None, "timed_out": False}
    try:
        if isinstance(body, bytes):
            reply = await client.post(url + path, content=body, headers={"content-type": "application/json"},
                                      timeout=timeout)
            outcome["status"] = reply.status_code
        elif body.get("stream"):
            async with client.stream("POST", url + path, json=body, timeout=timeout) as reply:
                outcome["status"] = reply.status_code
                chunks, done = 0, False
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        done = line == "data: [DONE]"
                        if '"error"' in line:
                            outcome["broken"] = True
                        if kind == "drop" and chunks >= 2:
                            break  # the client goes away mid-stream
                outcome["broken"] |= kind != "drop" and reply.status_code == 200 and not done
        else:
            reply = await client.post(url + path, json=body, timeout=timeout)
            outcome["status"] = reply.status_code
            if reply.status_code == 200 and kind == "seeded":
                outcome["text"] = reply.json()["choices"][0]["message"]["content"]
    except httpx.TimeoutException:
        outcome["timed_out"] = True
    except httpx.TransportError as error:
        outcome["broken"], outcome["error"] = True, repr(error)
    outcome["seconds"] = time.perf_counter() - started
    return outcome


async def run_clients(url: str, requests: list, clients: int, timeout: float) -> list[dict]:
    pending = collections.deque(enumerate(requests))
    results: list = [None] * len(requests)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            i, (kind, body) = pending.popleft()
            results[i] = await send(client, url, kind, body, timeout)

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return results


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def at_rest(url: str, pid: int, settle: float) -> tuple[float, dict]:
    """Wait until nothing runs or waits, and `settle` seconds more; the RSS (MiB) and the gauges then."""
    deadline = time.monotonic() + 120
    while True:
        values = metrics(url)
        if values.get("selfspec_queue_depth") == 0 and values.get("selfspec_batch_size") == 0:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    time.sleep(settle)
    return rss_mib(pid), metrics(url)


def start_server(args, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "selfspec.cli", "serve", args.model, "--model-name", "soak", "--port", str(port),
               "--dtype", args.dtype, "--threads", str(args.threads), "--max-batch", str(args.max_batch),
               "--prefix-cache", args.prefix_cache, "--max-request-bytes", str(4 * MIB)]
    print("server:", shlex.join(command), flush=True)
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become healthy")


def summarize(results: list[dict], before: float, after: float, gauges: dict, args) -> dict:
    by_kind = collections.Counter(r["kind"] for r in results)
    statuses = collections.Counter(str(r["status"]) for r in results)
    server_errors = sum(1 for r in results if r["status"] and r["status"] >= 500)
    broken = sum(1 for r in results if r["broken"])
    timed_out = sum(1 for r in results if r["timed_out"])
    bad_not_4xx = sum(1 for r in results if r["kind"] == "bad" and not (r["status"] and 400 <= r["status"] < 500))
    seeded: dict = {}
    for r in results:
        if r["kind"] == "seeded" and r["text"] is not None:
            seeded.setdefault(r["key"], set()).add(r["text"])
    unreproduced = sum(1 for texts in seeded.values() if len(texts) > 1)
    prefix = gauges.get("selfspec_prefix_cache_bytes", 0.0) / MIB
    net = after - prefix
    names = ("selfspec_queue_depth", "selfspec_batch_size", "selfspec_kv_cache_bytes")
    gauges_zero = all(gauges.get(name) == 0 for name in names)
    within = abs(net - before) <= args.rss_tolerance * before
    failures = [{k: r.get(k) for k in ("kind", "status", "error", "timed_out")} for r in results
                 if (r["status"] or 0) >= 500 or r["broken"] or (r["kind"] == "bad" and r["status"] != 413
                                                                  and not 400 <= (r["status"] or 0) < 500)]
    return dict(requests=len(results), by_kind=dict(by_kind), statuses=dict(statuses), server_errors=server_errors,
                broken_streams=broken, timed_out=timed_out, bad_not_4xx=bad_not_4xx,
                seeded_groups=len(seeded), seeded_differing=unreproduced, failures=failures[:10],
                rss_after_warmup_mib=round(before, 1), rss_at_rest_mib=round(after, 1),
                prefix_cache_mib=round(prefix, 1), rss_at_rest_less_prefix_mib=round(net, 1),
                gauges={name: gauges.get(name) for name in names}, idle_memory_returns=gauges.get(
                    "selfspec_idle_memory_returns_total"),
                passed=server_errors == 0 and broken == 0 and bad_not_4xx == 0 and gauges_zero and within)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--prefix-cache", default="1GiB", help="the server's --prefix-cache (default 1GiB, its default)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--bursts", type=int, default=4, help="send the requests in this many bursts, RSS read at rest "
                   "after each (default 4)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds one request may take (default 180)")
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    args = p.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    print("command: python -m benchmarks.soak", shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"machine: {cpu_model()} ({platform.machine()}), torch CPU capability {cpu_capability()}, "
          f"torch {torch.__version__}; server threads {args.threads}, {args.dtype}, --max-batch {args.max_batch}")
    requests = plan_requests(args.requests, args.seed, questions(args.data))
    server = start_server(args, port)
    try:
        wait_healthy(url, server)
        rss_ready = rss_mib(server.pid)
        warmup = plan_requests(3 * args.clients, args.seed + 1, questions(args.data))
        asyncio.run(run_clients(url, [(k, b) for k, b in warmup if k != "bad"], args.clients, args.timeout))
        before, _ = at_rest(url, server.pid, settle=2.0)
        print(f"RSS: {rss_ready:.0f} MiB ready, {before:.0f} MiB after warm-up", flush=True)
        started = time.perf_counter()
        results, bursts = [], []
        size = -(-len(requests) // args.bursts)
        for first in range(0, len(requests), size):
            results += asyncio.run(run_clients(url, requests[first : first + size], args.clients, args.timeout))
            rest, _ = at_rest(url, server.pid, settle=2.0)
            bursts.append(round(rest, 1))
            print(f"RSS at rest after {len(results)} requests: {rest:.0f} MiB", flush=True)
        seconds = time.perf_counter() - started
        for result, (kind, body) in zip(results, requests):
            if kind == "seeded":
                result["key"] = (body["seed"], body["messages"][0]["content"])
        after, gauges = at_rest(url, server.pid, settle=2.0)
    finally:
        server.terminate()
        server.wait(timeout=60)
    summary = summarize(results, before, after, gauges, args)
    summary.update(seconds=round(seconds, 1), rss_ready_mib=round(rss_ready, 1), rss_at_rest_per_burst_mib=bursts,
                   command=sys.argv,
                   machine=cpu_model(), capability=cpu_capability(), date=datetime.now(timezone.utc).isoformat())
    for key, value in summary.items():
        print(f"{key}: {value}")
    out = args.out / f"{datetime.now():%Y%m%d-%H%M%S}-soak-{Path(args.model).name}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"written: {out}/soak.json")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
