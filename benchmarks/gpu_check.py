"""CUDA check: losslessness on a GPU, and what a draft and a verify pass cost there.

    python -m benchmarks.gpu_check            # needs a CUDA device; about two minutes

1. Greedy equality with `model.generate` on CUDA, for every tiny architecture
   of the test suite, in float64 (exact) and float32 (first difference
   reported with the target's top-2 gap), over plans with layer subsets, early
   exits, an exit head, a draft vocabulary and n-gram proposals.
2. Seeded sampling on CUDA runs and reproduces (a CUDA generator).
3. Costs at SmolLM2-135M's shape (random weights: acceptance means nothing
   here, costs do), bfloat16: `model.generate` against selfspec's plain path
   (tokens/s over 128 tokens), and one layer, the LM head and a verify pass
   over k+1 tokens in units of one plain step (CUDA-synchronised medians).

The real checkpoints cannot travel to the GPU machine (size), so this script
builds everything from configs. It prints; it writes nothing.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import selfspec
from selfspec.runner import LayerRunner
from selfspec.testing import TINY_CONFIGS, make_head, make_vocab, random_prompt, tiny_model

DEVICE = torch.device(os.environ.get("SELFSPEC_CHECK_DEVICE", "cuda"))  # "cpu" for a dry run


def plans(folder: Path, model) -> list[selfspec.DraftPlan]:
    head = str(make_head(model, folder / f"head-{id(model)}", exit_layer=2, noise=0.05))
    vocab = str(make_vocab(model, folder / f"vocab-{id(model)}"))
    return [
        selfspec.DraftPlan(exit_layer=2, draft_length=4),
        selfspec.DraftPlan(layers=[0, 1, 3, 5], draft_length=6, adaptive=True, threshold=0.3),
        selfspec.DraftPlan(exit_layer=2, head=head, draft_length=3),
        selfspec.DraftPlan(exit_layer=2, head=head, draft_vocab=vocab, draft_vocab_size=20, draft_length=4, ngram=2),
        selfspec.DraftPlan(layers=[0, 2, 4], draft_vocab=vocab, draft_vocab_size=10, draft_length=5),
        selfspec.DraftPlan(exit_layer=5, head=str(make_head(model, folder / f"last-{id(model)}", exit_layer=5,
                                                            source_layer=5)), draft_length=4),
    ]


def check_greedy() -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float64, torch.float32):
            for arch in sorted(TINY_CONFIGS):
                model = copy.deepcopy(tiny_model(arch, dtype)).to(DEVICE)  # a copy: the cached CPU model stays
                same = total = 0
                notes = []
                for i, plan in enumerate(plans(Path(tmp), model)):
                    prompt = random_prompt(5 + 4 * i, seed=i).to(DEVICE)
                    with torch.no_grad():
                        ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
                    out = selfspec.wrap(model, plan=plan).generate(prompt, max_new_tokens=30)
                    total += 1
                    if torch.equal(out, ref):
                        same += 1
                        continue
                    n = min(out.shape[1], ref.shape[1])
                    first = next(j for j in range(prompt.shape[1], n) if out[0, j] != ref[0, j])
                    with torch.no_grad():
                        top2 = model(ref[:, :first]).logits[0, -1].float().topk(2).values
                    notes.append(f"plan {i} differs at {first - prompt.shape[1]} (top-2 gap {float(top2[0] - top2[1]):.1e})")
                exact = dtype == torch.float64
                ok &= same == total or not exact
                print(f"greedy {str(dtype):14s} {arch:12s} {same}/{total} identical {'; '.join(notes)}", flush=True)
    return ok


def check_sampling() -> bool:
    model = copy.deepcopy(tiny_model("llama", torch.float32)).to(DEVICE)
    with tempfile.TemporaryDirectory() as tmp:
        plan = plans(Path(tmp), model)[3]
        spec = selfspec.wrap(model, plan=plan)
        prompt = random_prompt(9).to(DEVICE)
        runs = [spec.generate(prompt, max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.9,
                              generator=torch.Generator(DEVICE).manual_seed(7)) for _ in range(2)]
    same = torch.equal(*runs)
    print(f"sampling on CUDA with a head, a vocabulary and n-grams: ran, seeded runs identical: {same}; "
          f"{spec.last_stats.drafted} drafted, {spec.last_stats.accepted} accepted", flush=True)
    return same


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def sync_time(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def costs() -> None:
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE, torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, 49152, (1, 256), device=DEVICE)
    hf = sync_time(lambda: model.generate(prompt, do_sample=False, max_new_tokens=128, min_new_tokens=128), 5)
    plain = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
    ours = sync_time(lambda: plain.generate(prompt, max_new_tokens=128), 5)
    print(f"SmolLM2 shape, bf16, 256-token prompt, 128 new tokens: model.generate {128 / hf:.1f} tok/s, "
          f"selfspec plain path {128 / ours:.1f} tok/s ({hf / ours:.2f}x)", flush=True)

    parts = selfspec.wrap(model, plan=selfspec.DraftPlan.plain()).parts
    runner = LayerRunner(parts, capacity=300, device=DEVICE)
    runner.run(runner.embed(prompt[0].tolist(), 0), range(30), 0)
    start = 256

    def step(q: int, layers) -> None:
        runner.cache.crop(start)
        runner.logits(runner.run(runner.embed([1] * q, start), layers, start)).argmax(-1).tolist()

    one = sync_time(lambda: step(1, range(30)))
    layer = (sync_time(lambda: step(1, range(10))) - sync_time(lambda: step(1, range(0)))) / 10
    head = sync_time(lambda: step(1, range(0)))
    verify = {q - 1: sync_time(lambda q=q: step(q, range(30))) / one for q in (2, 3, 5, 9, 17)}
    print(f"plain step {one * 1e3:.2f} ms; in plain steps: one layer {layer / one:.3f}, embed + LM head + argmax "
          f"{head / one:.3f}; verify over k+1 tokens: " + ", ".join(f"k={k}: {v:.2f}" for k, v in verify.items()))


def main() -> int:
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}")
    greedy = check_greedy()
    sampling = check_sampling()
    costs()
    print(f"RESULT: float64 greedy exact on CUDA: {greedy}; seeded sampling reproduces: {sampling}")
    return 0 if greedy and sampling else 1


if __name__ == "__main__":
    raise SystemExit(main())
