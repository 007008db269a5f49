"""`serve_load --multi-turn`: chats of several turns over a long document, served with and without the prefix cache.

    python -m benchmarks.serve_load --multi-turn                          # documents of ~1,500 and ~3,000 tokens
    python -m benchmarks.serve_load --multi-turn --documents 1500 --turns 2 --max-tokens 16   # a quick look

Two servers of the one model run in this process (uvicorn threads on
127.0.0.1), as `selfspec serve` does: one with `--prefix-cache` (its default
budget), one with it off. A conversation's first turn carries the document
and a question; each later turn resends the whole history with the model's
last answer and a new question, as a chat client does. Each turn goes to both
servers in turn (streaming, greedy), and the next turn's history takes the
cached server's answer. Per turn: the time to first token as the client sees
it, the decode speed after it, the prompt tokens the server took from its
cache (`usage.prompt_tokens_details.cached_tokens`), and whether the two
answers are the same.

It knows HTTP and the conversation; the documents and questions are
`multi_turn.py`'s (the same run through the Python API).
"""

from __future__ import annotations

import json
import statistics
import time

import httpx

import selfspec

from .multi_turn import QUESTIONS, document


def streamed_turn(url: str, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    """One streaming greedy chat: time to first token and decode tok/s as the client sees them, text, usage."""
    body = {"model": "multi-turn", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    parts: list[str] = []
    usage: dict = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.read().decode(errors='replace')[:200]}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error'].get('message')}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
    done = time.perf_counter()
    tokens = usage.get("completion_tokens", 0)
    return {"ttft": (first or done) - sent, "decode_tok_s": max(0, tokens - 1) / max(1e-9, done - (first or done)),
            "text": "".join(parts), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def parted_at(a: str, b: str) -> int | None:
    """The first character where two answers differ; None where they are the same."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def conversation(urls: dict[str, str], doc: str, turns: int, max_tokens: int, timeout: float, log) -> list[dict]:
    messages, rows = [], []
    for t in range(turns):
        question = QUESTIONS[t % len(QUESTIONS)]
        messages.append({"role": "user", "content": f"{doc}\n\n{question}" if t == 0 else question})
        order = ["cache", "no-cache"] if t % 2 == 0 else ["no-cache", "cache"]  # alternate who goes first
        answers = {name: streamed_turn(urls[name], messages, max_tokens, timeout) for name in order}
        warm, cold = answers["cache"], answers["no-cache"]
        row = {"turn": t + 1, "prompt_tokens": warm["prompt_tokens"], "cached_tokens": warm["cached_tokens"],
               "cached_tokens_no_cache": cold["cached_tokens"], "ttft_cache": warm["ttft"],
               "ttft_no_cache": cold["ttft"], "decode_cache": warm["decode_tok_s"],
               "decode_no_cache": cold["decode_tok_s"], "same": warm["text"] == cold["text"],
               "parted_at": parted_at(warm["text"], cold["text"]), "answer_cache": warm["text"],
               "answer_no_cache": cold["text"]}
        rows.append(row)
        messages.append({"role": "assistant", "content": warm["text"]})
        log(f"  turn {row['turn']}: {row['prompt_tokens']} prompt tokens, {row['cached_tokens']} cached; time to "
            f"first token {row['ttft_cache']:.2f} s with the cache, {row['ttft_no_cache']:.2f} s without "
            f"({row['ttft_cache'] / row['ttft_no_cache']:.2f}x); decode {row['decode_cache']:.1f} / "
            f"{row['decode_no_cache']:.1f} tok/s; same answer: {row['same']}"
            + ("" if row["same"] else f" (they part at character {row['parted_at']})"))
    return rows


def run(model, tokenizer, *, plan, documents: list[int], turns: int, max_tokens: int, max_batch: int,
        request_timeout: float, data, log) -> dict:
    """Both servers, every document's conversation; per document its turns and the median ratio on turns 2+."""
    from selfspec.serving import create_app

    from .serve_load import serving

    apps = {name: create_app(selfspec.wrap(model, plan=plan, prefix_cache=budget), tokenizer,
                             model_name="multi-turn", max_batch=max_batch)
            for name, budget in (("cache", "1GiB"), ("no-cache", None))}
    results = {}
    with serving(apps["cache"]) as cache_url, serving(apps["no-cache"]) as plain_url:
        urls = {"cache": cache_url, "no-cache": plain_url}
        streamed_turn(cache_url, [{"role": "user", "content": "Hello"}], 4, request_timeout)  # warm both up
        streamed_turn(plain_url, [{"role": "user", "content": "Hello"}], 4, request_timeout)
        for size in documents:
            doc = document(tokenizer, data, size)
            log(f"document of {len(tokenizer(doc).input_ids)} tokens, {turns} turns:")
            rows = conversation(urls, doc, turns, max_tokens, request_timeout, log)
            later = [r["ttft_cache"] / r["ttft_no_cache"] for r in rows[1:]]
            results[size] = {"turns": rows, "ttft_ratio_later_median": statistics.median(later) if later else None,
                             "ttft_ratio_later_max": max(later) if later else None,
                             "same": sum(r["same"] for r in rows)}
            if later:
                log(f"  turns 2+: time to first token {statistics.median(later):.2f}x without the cache (median, "
                    f"worst {max(later):.2f}x); answers the same on {results[size]['same']}/{len(rows)} turns")
    return results
