"""Multi-turn chat over a long document, with and without the prefix cache: time to first token per turn.

    python -m benchmarks.multi_turn                      # SmolLM2, bf16, documents of ~1,500 and ~3,000 tokens
    python -m benchmarks.multi_turn --documents 1500 --turns 2 --new-tokens 16   # a quick look

Each conversation has `--turns` turns over one document (Spec-Bench news
articles, joined until the document reaches the size asked): the first turn
carries the document and a question, each later turn resends the whole
history with the model's last answer and a new question, as a chat client
does. Two wrappers of the same model answer every turn, interleaved: one with
the prefix cache (`wrap(prefix_cache=...)`), one without. On a CPU the time to
first token is the prefill (`last_stats.prefill_seconds`, plus the first
token's choice); the table gives it per turn for both, their ratio, the
tokens the cache supplied, decode speed, and whether the answers are the same.
It runs through the Python API; the server adds its HTTP and queueing on top
(`tests/test_serve.py` checks that its turns reuse the cache too).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import selfspec
from selfspec.costs import cpu_capability, cpu_model

from .workload import DEFAULT_DATA, save_results

QUESTIONS = ("Summarise the document above in three sentences.", "Which people or organisations does it name?",
             "What happened first, according to the document?", "Suggest a short title for it.",
             "Is anything in it uncertain? Answer briefly.")


def document(tokenizer, data: Path, tokens: int) -> str:
    """Spec-Bench news articles (the summarization questions' texts), joined until about `tokens` tokens."""
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
    articles = [r["turns"][0] for r in rows if r["category"] == "summarization"]
    text = ""
    for article in sorted(articles, key=len, reverse=True):
        text = f"{text}\n\n{article}".strip()
        if len(tokenizer(text).input_ids) >= tokens:
            break
    words = text.split(" ")
    while len(tokenizer(" ".join(words)).input_ids) > tokens:
        words = words[: int(len(words) * 0.97)]
    return " ".join(words)


def turn(spec, tokenizer, messages: list[dict], new_tokens: int) -> dict:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    began = time.perf_counter()
    out = spec.generate(ids, max_new_tokens=new_tokens)
    seconds = time.perf_counter() - began
    stats = spec.last_stats
    new = out[0, ids.shape[1]:]
    decode = max(1e-9, seconds - stats.prefill_seconds)
    return {"prompt_tokens": ids.shape[1], "cached_tokens": stats.cached_tokens, "ttft": stats.prefill_seconds,
            "decode_tok_s": max(0, len(new) - 1) / decode, "text": tokenizer.decode(new, skip_special_tokens=True),
            "ids": new.tolist()}


def conversation(warm, cold, tokenizer, doc: str, turns: int, new_tokens: int) -> list[dict]:
    messages, rows = [], []
    for t in range(turns):
        question = QUESTIONS[t % len(QUESTIONS)]
        messages.append({"role": "user", "content": f"{doc}\n\n{question}" if t == 0 else question})
        with_cache = turn(warm, tokenizer, messages, new_tokens)
        without = turn(cold, tokenizer, messages, new_tokens)
        rows.append({"turn": t + 1, "prompt_tokens": with_cache["prompt_tokens"],
                     "cached_tokens": with_cache["cached_tokens"], "ttft_cache": with_cache["ttft"],
                     "ttft_no_cache": without["ttft"], "decode_cache": with_cache["decode_tok_s"],
                     "decode_no_cache": without["decode_tok_s"], "same": with_cache["ids"] == without["ids"]})
        messages.append({"role": "assistant", "content": with_cache["text"]})
        r = rows[-1]
        print(f"  turn {r['turn']}: {r['prompt_tokens']} prompt tokens, {r['cached_tokens']} cached; time to first "
              f"token {r['ttft_cache']:.2f} s with the cache, {r['ttft_no_cache']:.2f} s without "
              f"({r['ttft_cache'] / r['ttft_no_cache']:.2f}x); decode {r['decode_cache']:.1f} / "
              f"{r['decode_no_cache']:.1f} tok/s; same answer: {r['same']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--documents", default="1500,3000", help="document sizes in tokens (comma list)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = selfspec.load(args.model, dtype=args.dtype)
    warm = selfspec.wrap(model, prefix_cache="1GiB")
    cold = selfspec.wrap(model)
    header = {"command": "python -m benchmarks.multi_turn " + shlex.join(sys.argv[1:] if argv is None else argv),
              "cpu": cpu_model(), "capability": cpu_capability(), "threads": args.threads,
              "dtype": args.dtype, "torch": torch.__version__, "plan": warm.describe_plan()}
    print("\n".join(f"{k}: {v}" for k, v in header.items()), flush=True)
    results = {}
    for size in (int(s) for s in args.documents.split(",")):
        doc = document(tokenizer, args.data, size)
        print(f"document of {len(tokenizer(doc).input_ids)} tokens, {args.turns} turns:", flush=True)
        results[size] = rows = conversation(warm, cold, tokenizer, doc, args.turns, args.new_tokens)
        later = [r["ttft_cache"] / r["ttft_no_cache"] for r in rows[1:]]
        if later:
            print(f"  turns 2+: time to first token {statistics.median(later):.2f}x without the cache (median); "
                  f"answers the same on {sum(r['same'] for r in rows)}/{len(rows)} turns", flush=True)
    save_results(args.out, "multi-turn", header, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
