"""GPU check: losslessness on CUDA, the static step's graphs, what passes cost there, and a projection.

    python -m benchmarks.gpu_check            # needs a CUDA device; about five minutes
    SELFSPEC_CHECK_DEVICE=cpu python -m benchmarks.gpu_check --quick   # a dry run of the script here

On the lent GPU machine (its image has transformers 5.17; selfspec is tested
with 5.24), carry the wheel: here, once, `python -m pip download --no-deps
--only-binary=:all: --python-version 3.12 -d .whl transformers==5.24.0`
(`.whl/` ignored in `.git/info/exclude`), then run with carry [".whl"]:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check

1. Greedy equality with `model.generate` on CUDA, for every tiny architecture
   of the test suite, eager and on the fast step (`step="graphs"`), in float64
   (exact) and float32 (first difference reported with the target's top-2
   gap), over plans with layer subsets, early exits, an exit head, a draft
   vocabulary, a feature head (chain and tree), n-gram proposals and token
   trees (a layer draft's, n-grams', recycled ones).
2. Seeded sampling on CUDA runs and reproduces (a CUDA generator), on both steps.
3. A model with layers on two devices (accelerate's `device_map`, half the
   layers in CPU memory) runs eagerly and equals `model.generate`.
4. Costs at SmolLM2-135M's and Gemma 3 270M's shapes (random weights:
   acceptance means nothing here, costs do), bfloat16, 128-token prompt, 128
   new tokens: `model.generate`, HF static cache + `torch.compile` (its compile
   time apart), selfspec's plain path eager and on graphs (tokens/s); then, on
   the graphed runner, a draft step through m layers and a verify pass over q
   tokens in units of one plain step, against the issue's targets; a feature
   head's draft step (one layer and the LM head) in plain steps; and a
   plain step on a runner kept at 8,192 positions, at its captured span and
   attending to every position.
5. Offload timing at SmolLM2's shape, half the layers in CPU memory:
   `model.generate`, selfspec plain and default, and the measured verify costs.
6. A left-padded batch (n-gram drafts, layer chains resumed after the exact
   prefix, layer trees) equals each prompt alone on the device (float64,
   every tiny architecture); at SmolLM2's shape, a batch of 8 x 64
   tokens against `model.generate` batched and one prompt at a time.
7. A PROJECTION: the speed each plan of `benchmarks/data/acceptance_*.json`
   (round outcomes measured on a CPU with the real checkpoint, by
   `benchmarks.acceptance_profile`) would reach with the GPU costs of 4,
   its draft length chosen for those costs, against HF static + compile;
   a feature head's rounds (the trained SmolLM2 head) at its draft step.
8. A PROJECTION for trees: the passes by width of a CPU Spec-Bench run whose
   policy decided with the flat profile (`benchmarks/data/flat_passes_smollm2.json`),
   priced at the GPU costs of 4.

The real checkpoints cannot travel to the GPU machine (size), so this script
builds everything from configs. It prints; it writes nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import selfspec
from selfspec.static import GraphedRunner, StaticRunner
from selfspec.eagle3 import llama_structure_problem
from selfspec.feature_head import FeatureHead
from selfspec.registry import model_parts
from selfspec.testing import TINY_CONFIGS, make_feature_head, make_head, make_vocab, random_prompt, tiny_model

DEVICE = torch.device(os.environ.get("SELFSPEC_CHECK_DEVICE", "cuda"))  # "cpu" for a dry run
FAST = "graphs" if DEVICE.type == "cuda" else "static"  # the step a GPU user gets by default
DATA = Path(__file__).parent / "data"
PROMPT, NEW = 128, 128


def plans(folder: Path, model) -> list[selfspec.DraftPlan]:
    head = str(make_head(model, folder / f"head-{id(model)}", exit_layer=2, noise=0.05))
    vocab = str(make_vocab(model, folder / f"vocab-{id(model)}"))
    features = str(make_feature_head(model, folder / f"features-{id(model)}"))
    eagle3 = []  # a head of EAGLE-3's layout, where the family's layer has the Llama structure
    if llama_structure_problem(model_parts(model).layers[-1]) is None:
        head3 = str(make_feature_head(model, folder / f"eagle3-{id(model)}", layout="eagle3"))
        eagle3 = [selfspec.DraftPlan(head=head3, tree=10, draft_length=4)]
    return eagle3 + [
        selfspec.DraftPlan(head=features, draft_length=4, policy="fixed"),  # a feature head's chain
        selfspec.DraftPlan(head=features, tree=10, draft_vocab=vocab, draft_length=4),  # and its tree
        selfspec.DraftPlan(exit_layer=2, draft_length=4),
        selfspec.DraftPlan(layers=[0, 1, 3, 5], draft_length=6, adaptive=True, threshold=0.3, policy="fixed"),
        selfspec.DraftPlan(exit_layer=2, head=head, draft_length=3),
        selfspec.DraftPlan(exit_layer=2, head=head, draft_vocab=vocab, draft_vocab_size=20, draft_length=4, ngram=2),
        selfspec.DraftPlan(layers=[0, 2, 4], draft_vocab=vocab, draft_vocab_size=10, draft_length=5),
        selfspec.DraftPlan(exit_layer=5, head=str(make_head(model, folder / f"last-{id(model)}", exit_layer=5,
                                                            source_layer=5)), draft_length=4),
        selfspec.DraftPlan(layers=[0, 2, 5], tree=10, draft_length=4, policy="fixed"),  # a layer tree (eager)
        selfspec.DraftPlan(ngram=2, tree=8, layers=[0, 1, 4], draft_length=4, policy="fixed"),  # n-gram trees
        selfspec.DraftPlan(recycle=True, ngram=2, tree=12, layers=[0, 2], draft_length=5),  # recycled trees
    ]


def first_difference(model, out, ref, prompt_length) -> str:
    n = min(out.shape[1], ref.shape[1])
    first = next(j for j in range(prompt_length, n) if out[0, j] != ref[0, j])
    with torch.no_grad():
        top2 = model(ref[:, :first]).logits[0, -1].float().topk(2).values
    return f"differs at {first - prompt_length} (top-2 gap {float(top2[0] - top2[1]):.1e})"


def check_greedy(archs) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float64, torch.float32):
            for arch in archs:
                model = copy.deepcopy(tiny_model(arch, dtype)).to(DEVICE)  # a copy: the cached CPU model stays
                for step in ("eager", FAST):
                    same = total = 0
                    notes = []
                    for i, plan in enumerate(plans(Path(tmp), model)):
                        prompt = random_prompt(5 + 4 * i, seed=i).to(DEVICE)
                        with torch.no_grad():
                            ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
                        spec = selfspec.wrap(model, plan=plan, step=step)
                        try:
                            out = spec.generate(prompt, max_new_tokens=30)
                        except Exception as error:  # report, go on: one failure must not hide the rest
                            notes.append(f"plan {i} raised {type(error).__name__}: {error}")
                            total += 1
                            continue
                        total += 1
                        if torch.equal(out, ref):
                            same += 1
                        else:
                            notes.append(f"plan {i} " + first_difference(model, out, ref, prompt.shape[1]))
                    exact = dtype == torch.float64
                    ok &= same == total or not exact
                    how = spec.last_stats.step if spec.last_stats else step
                    print(f"greedy {str(dtype):14s} {arch:12s} {step:7s} {same}/{total} identical ({how}) "
                          f"{'; '.join(notes)}", flush=True)
    return ok


def check_sampling() -> bool:
    model = copy.deepcopy(tiny_model("llama", torch.float32)).to(DEVICE)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        plan = plans(Path(tmp), model)[3]
        for step in ("eager", FAST):
            spec = selfspec.wrap(model, plan=plan, step=step)
            prompt = random_prompt(9).to(DEVICE)
            runs = [spec.generate(prompt, max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.9,
                                  generator=torch.Generator(DEVICE).manual_seed(7)) for _ in range(2)]
            same = torch.equal(*runs)
            ok &= same
            print(f"sampling ({step}) with a head, a vocabulary and n-grams: ran, seeded runs identical: {same}; "
                  f"{spec.last_stats.drafted} drafted, {spec.last_stats.accepted} accepted", flush=True)
    return ok


BATCH_PLANS = {
    "n-gram": selfspec.DraftPlan(ngram=2, draft_length=4, policy="fixed"),
    "layer chains, resumed": selfspec.DraftPlan(layers=(0, 1, 2, 4), draft_length=3, policy="fixed"),
    "layer trees": selfspec.DraftPlan(layers=(0, 2, 5), tree=10, draft_length=3, policy="fixed"),
}


def check_batch(archs) -> bool:
    """A left-padded batch of 4 on the device (n-gram drafts, layer chains whose verify resumes after the exact
    prefix, layer trees): every row equals its prompt alone (float64)."""
    ok = True
    for arch in archs:
        model = copy.deepcopy(tiny_model(arch, torch.float64)).to(DEVICE)
        prompts = [(random_prompt(3 + 2 * i, seed=i)[0].tolist() * 3)[: 4 + 5 * i] for i in range(4)]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)
        refs = []
        for p in prompts:
            with torch.no_grad():
                refs.append(model.generate(torch.tensor([p], device=DEVICE), do_sample=False, max_new_tokens=24))
        for name, plan in BATCH_PLANS.items():
            spec = selfspec.wrap(model, plan=plan)
            out = spec.generate(ids, attention_mask=mask, max_new_tokens=24)
            same = sum(torch.equal(out[i, width : width + ref.shape[1] - len(p)], ref[0, len(p) :])
                       for i, (p, ref) in enumerate(zip(prompts, refs)))
            ok &= same == len(prompts)
            stats = spec.last_stats
            print(f"batch float64 {arch:12s} {name:22s} {same}/{len(prompts)} rows identical to alone; "
                  f"{stats.drafted} drafted, {stats.accepted} accepted, {stats.resumed_passes} passes resumed, "
                  f"{sum(s.layer_tree_rounds for s in stats.row_stats)} layer-tree row-rounds", flush=True)
    return ok


def batch_throughput(name: str, rows: int = 8) -> None:
    """At a real shape (random weights), tok/s of a batch of `rows`: selfspec's batch (plain plan) against
    `model.generate` on the same padded batch and one prompt at a time."""
    config_for, model_class = SHAPES[name]
    model = model_class(config_for()).to(DEVICE, torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (rows, PROMPT), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1::2, : PROMPT // 4] = 0  # every other row left-padded
    spec = selfspec.wrap(model, plan=selfspec.DraftPlan.plain())
    new = 64

    def ours():
        spec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None)

    def hf_batch():
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    def hf_alone():
        with torch.no_grad():
            for i in range(rows):
                model.generate(ids[i : i + 1, mask[i].bool()], max_new_tokens=new, min_new_tokens=new, do_sample=False)

    times = {what: sync_time(fn, repeats=3) for what, fn in
             (("selfspec batch", ours), ("model.generate batch", hf_batch), ("model.generate one at a time", hf_alone))}
    print(f"{name} bf16, {rows} rows x {new} tokens (tok/s): " + ", ".join(
        f"{what} {rows * new / t:.0f}" for what, t in times.items()), flush=True)
    del model, spec


def check_offload() -> bool | None:
    """Half the layers in CPU memory (accelerate's hooks move activations): selfspec equals generate, streamed and
    through the hooks, on the eager and the static step."""
    if DEVICE.type != "cuda":
        print("offload: skipped (no CUDA device)")
        return None
    try:
        from accelerate import dispatch_model
    except ImportError:
        print("offload: skipped (accelerate is not installed)")
        return None
    model = copy.deepcopy(tiny_model("llama", torch.float64))
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    device_map.update({f"model.layers.{i}": 0 if i < layers // 2 else "cpu" for i in range(layers)})
    try:
        model = dispatch_model(model, device_map=device_map)
        prompt = random_prompt(11, seed=3).to(DEVICE)
        with torch.no_grad():
            ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
        plan = selfspec.DraftPlan(exit_layer=layers // 2, draft_length=4, policy="fixed")
        # selfspec's stream and accelerate's hooks, on the eager and the static step
        outs = {(stream, step): selfspec.wrap(model, plan=plan, step=step, offload_stream=stream).generate(
            prompt, max_new_tokens=30) for stream in (True, False) for step in ("eager", "static")}
    except Exception as error:
        print(f"offload: raised {type(error).__name__}: {error}")
        return False
    same = {key: torch.equal(out, ref) for key, out in outs.items()}
    print(f"offload: layers {layers // 2}..{layers - 1} in CPU memory, draft = the resident layers: "
          "identical to generate: " + ", ".join(f"{'streamed' if stream else 'hooks'} {step} {ok}"
                                                for (stream, step), ok in same.items()), flush=True)
    return all(same.values())


def offload_timing(name: str = "SmolLM2-135M", new: int = 48) -> None:
    """At a real shape (random weights), half the layers in CPU memory behind the GPU: `model.generate` on that
    device map, selfspec's plain path and its default (resident drafts), tokens/s; and the measured verify pass
    over q tokens in plain steps (the flat verify that offload gives)."""
    from selfspec.offload import offload_layers

    make_config, model_class = SHAPES[name]
    torch.manual_seed(0)
    model = model_class(make_config()).to(DEVICE, torch.bfloat16).eval()
    layers = model.config.num_hidden_layers
    model = offload_layers(model, layers // 2, folder="/tmp/selfspec-offload", slow="cpu")
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), device=DEVICE)
    speeds = {}
    plain = selfspec.wrap(model, plan=selfspec.DraftPlan(draft_length=0))
    hooks = selfspec.wrap(model, plan=selfspec.DraftPlan(draft_length=0), offload_stream=False)
    default = selfspec.wrap(model)
    static = selfspec.wrap(model, step="static")
    runs = {"model.generate": lambda: model.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new),
            "selfspec plain, accelerate's hooks": lambda: hooks.generate(prompt, max_new_tokens=new,
                                                                          min_new_tokens=new),
            "selfspec plain, streamed": lambda: plain.generate(prompt, max_new_tokens=new, min_new_tokens=new),
            "selfspec default, streamed": lambda: default.generate(prompt, max_new_tokens=new, min_new_tokens=new),
            "selfspec default, streamed, static step": lambda: static.generate(prompt, max_new_tokens=new,
                                                                               min_new_tokens=new)}
    with torch.no_grad():
        for label, run in runs.items():  # sync_time warms up (the default's cost table is measured then)
            speeds[label] = new / sync_time(run, repeats=2)
    table = default.measure_costs()
    print(f"{name} bf16, layers {layers // 2}..{layers - 1} in CPU memory, {new} new tokens (tok/s; random weights, "
          "so drafts mean little): " + ", ".join(f"{k} {v:.1f}" for k, v in speeds.items())
          + f"; verify of q tokens in plain steps: {[round(t / table.step, 2) for t in table.verify]}", flush=True)


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


def smollm2_shape():
    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    )


def gemma3_270m_shape():
    return transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
        rope_theta=1000000.0, query_pre_attn_scalar=256, tie_word_embeddings=True,
    )


SHAPES = {"SmolLM2-135M": (smollm2_shape, transformers.LlamaForCausalLM),
          "Gemma 3 270M": (gemma3_270m_shape, transformers.Gemma3ForCausalLM)}


def hf_static_compile(model, prompt) -> tuple[float, float]:
    """(compile seconds, seconds per 128-token generation) for model.generate on a StaticCache, compiled."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW + 16)
    config = transformers.CompileConfig()
    config._compile_all_devices = True  # on a CPU dry run too

    def run():
        cache.reset()
        model.generate(prompt, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, cache=cache,
                       compile_config=config)

    began = time.perf_counter()
    run()
    sync()
    first = time.perf_counter() - began
    steady = sync_time(run, 3)
    return max(0.0, first - steady), steady


@torch.no_grad()
def costs(name: str, quick: bool) -> dict:
    make_config, model_class = SHAPES[name]
    torch.manual_seed(0)
    model = model_class(make_config()).to(DEVICE, torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    layers = model.config.num_hidden_layers
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT), device=DEVICE)
    repeats = 2 if quick else 5
    result = {}
    result["model.generate"] = sync_time(lambda: model.generate(prompt, do_sample=False, max_new_tokens=NEW,
                                                               min_new_tokens=NEW), repeats)
    if not quick:
        try:
            compile_seconds, result["HF static+compile"] = hf_static_compile(model, prompt)
            print(f"{name}: HF static+compile compiled in {compile_seconds:.1f} s", flush=True)
        except Exception as error:
            print(f"{name}: HF static+compile failed: {type(error).__name__}: {error}", flush=True)
    for step in ("eager", FAST):
        plain = selfspec.wrap(model, plan=selfspec.DraftPlan.plain(), step=step)
        result[f"selfspec plain {step}"] = sync_time(lambda: plain.generate(prompt, max_new_tokens=NEW), repeats)
        if step != "eager":  # how the fast step ran: graphs captured (and their time), or why not
            print(f"{name}: selfspec plain {step}: {plain.last_stats.step}", flush=True)
    hf = result["model.generate"]
    print(f"{name}, bf16, {PROMPT}-token prompt, {NEW} new tokens (tok/s; x model.generate): " + ", ".join(
        f"{k} {NEW / v:.1f} ({hf / v:.2f}x)" for k, v in result.items()), flush=True)

    # Passes on the fast runner, in plain steps.
    parts = selfspec.wrap(model, plan=selfspec.DraftPlan.plain()).parts
    runner_class = GraphedRunner if FAST == "graphs" else StaticRunner
    runner = runner_class(parts, capacity=PROMPT + 64, max_width=33)
    runner.run(runner.embed(prompt[0].tolist(), 0), range(layers), 0)
    token = prompt[:, :1]

    def step(q: int, depth: int) -> None:
        runner.cache.crop(PROMPT)
        ids = token.expand(1, q)
        hidden = runner.run(runner.embed(ids, PROMPT), range(depth), PROMPT)
        runner.logits(hidden).argmax(-1)

    one = sync_time(lambda: step(1, layers))
    depths = sorted({1, layers // 4, layers // 2, (3 * layers) // 4, layers - 1})
    draft = {m: sync_time(lambda m=m: step(1, m)) / one for m in depths}
    verify = {q: sync_time(lambda q=q: step(q, layers)) / one for q in (2, 4, 8, 16, 32)}
    print(f"{name}: plain step {one * 1e3:.3f} ms on the {FAST} runner; draft step through m of {layers} layers "
          "(target <= m/L + 0.1): " + ", ".join(f"m={m}: {c:.2f} ({m / layers + 0.1:.2f})" for m, c in draft.items()),
          flush=True)
    print(f"{name}: verify pass over q tokens (target <= 1.30 for q <= 16): "
          + ", ".join(f"q={q}: {c:.2f}" for q, c in verify.items()), flush=True)
    features = feature_step(parts, runner_class, prompt) / one
    print(f"{name}: a feature head's draft step (one layer and the LM head): {features:.3f} plain steps", flush=True)
    kept = {label: seconds / one for label, seconds in kept_runner_step(parts, prompt, layers).items()}
    print(f"{name}: on a kept runner grown to {KEPT_CAPACITY} positions, a plain step at {PROMPT} entries: "
          f"{kept['span']:.2f} plain steps at its span, {kept['whole']:.2f} attending to every position "
          "(what graphs did before spans)", flush=True)
    best = result.get("HF static+compile")
    fast = result[f"selfspec plain {FAST}"]
    print(f"{name} TARGETS: plain {FAST} {hf / fast:.2f}x model.generate (target >= 5), "
          + (f"{best / fast:.2f}x HF static+compile (target >= 1); " if best else "")
          + f"draft steps within m/L + 0.1: {all(c <= m / layers + 0.1 for m, c in draft.items())}; "
          f"verify <= 1.3: {all(c <= 1.3 for q, c in verify.items() if q <= 16)}", flush=True)
    runner = None
    return {"layers": layers, "step": one, "draft": draft, "verify": verify, "feature_step": features, "per_token": {
        k: v / NEW for k, v in result.items()}}


KEPT_CAPACITY = 8192  # a runner the engine kept after a long generation


def feature_step(parts, runner_class, prompt: torch.Tensor) -> float:
    """Seconds of one feature-head draft step (random head) after a prefill of `prompt`, on `runner_class`."""
    head = FeatureHead.from_model(parts)
    runner = runner_class(parts, capacity=PROMPT + 64, max_width=33, head=head)
    runner.run(runner.embed(prompt[0].tolist(), 0), range(parts.num_layers), 0)
    runner.run(runner.embed(prompt[0].tolist(), 0), [head.slot], 0)
    before = torch.zeros(1, 1, parts.embed.weight.shape[1], device=DEVICE, dtype=parts.dtype)

    def step() -> None:
        runner.cache.crop(PROMPT)
        hidden = runner.run(head.inputs(runner.embed(prompt[:, :1], PROMPT), before), [head.slot], PROMPT)
        runner.logits(hidden).argmax(-1)

    return sync_time(step)


def kept_runner_step(parts, prompt: torch.Tensor, layers: int) -> dict[str, float]:
    """Seconds of a plain step at the prompt's length on a runner of `KEPT_CAPACITY` positions: captured at the
    span `captured_span` picks, and at the whole capacity."""
    seconds = {}
    for label, span_min in (("span", selfspec.static.CAPTURED_SPAN_MIN), ("whole", 1 << 30)):
        saved, selfspec.static.CAPTURED_SPAN_MIN = selfspec.static.CAPTURED_SPAN_MIN, span_min
        try:
            runner = (GraphedRunner if FAST == "graphs" else StaticRunner)(parts, capacity=KEPT_CAPACITY, max_width=33)
            runner.run(runner.embed(prompt[0].tolist(), 0), range(layers), 0)

            def step() -> None:
                runner.cache.crop(prompt.shape[1])
                runner.logits(runner.run(runner.embed(prompt[:, :1], prompt.shape[1]), range(layers),
                                         prompt.shape[1])).argmax(-1)

            seconds[label] = sync_time(step)
        finally:
            selfspec.static.CAPTURED_SPAN_MIN = saved
    return seconds


def interpolate(points: dict[int, float], x: int) -> float:
    """Linear between measured points (constant beyond them)."""
    keys = sorted(points)
    if x <= keys[0]:
        return points[keys[0]] * (x / keys[0] if keys[0] else 1.0)
    for lo, hi in zip(keys, keys[1:]):
        if x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[keys[-1]]


def verify_cost(verify: dict[int, float], width: int) -> float:
    """A verify pass over `width` tokens runs at its bucket (a power of two)."""
    if width <= 1:
        return 1.0
    bucket = 1 << (width - 1).bit_length()
    return verify.get(bucket, max(verify.values()))


def projection_inputs(name: str, measured: dict, label: str) -> tuple[dict | None, dict | None]:
    """The CPU-measured data file `name` and the SmolLM2 GPU timings, or (None, None) with a line saying why."""
    path = DATA / name
    if not path.is_file() or "SmolLM2-135M" not in measured:
        print(f"{label}: skipped ({path} or the SmolLM2 timings missing)")
        return None, None
    return json.loads(path.read_text()), measured["SmolLM2-135M"]


def projection(measured: dict) -> None:
    """Speed per plan from CPU-measured round outcomes and these GPU costs (labelled: a projection)."""
    for name in sorted(path.name for path in DATA.glob("acceptance_smollm2*.json")) or ["acceptance_smollm2.json"]:
        data, gpu = projection_inputs(name, measured, "PROJECTION")
        if data is not None:
            project_plans(data, gpu)


def project_plans(data: dict, gpu: dict) -> None:
    """`projection` for one CPU-measured acceptance file."""
    per_token = gpu["per_token"]
    baseline = per_token.get("HF static+compile", per_token["model.generate"])
    baseline_name = "HF static+compile" if "HF static+compile" in per_token else "model.generate"
    plain = per_token[f"selfspec plain {FAST}"]
    print(f"PROJECTION (not a measurement): SmolLM2-135M bf16 on this GPU, acceptance from {data['command']} "
          f"({data['prompts']}), pass costs from the timings above; against {baseline_name}.")
    for name, entry in data["plans"].items():
        rounds = [(outcome.split()[0], int(outcome.split()[1]), int(outcome.split()[2]), count)
                  for outcome, count in entry["outcomes"].items()]
        if entry.get("feature_head"):  # one layer and the LM head, whatever the target's depth
            draft_step = gpu["feature_step"]
        else:
            draft_step = interpolate(gpu["draft"], entry["draft_layers"]) if entry["draft_layers"] else 0.0
        longest = max(r[1] for r in rounds)
        best = None
        for k_ngram in range(longest + 1):  # per source, the draft length these costs favour (as the cost policy)
            for k_layers in range(longest + 1):
                tokens = seconds = 0.0
                for source, drafted, accepted, count in rounds:
                    used = min(drafted, k_ngram if source.startswith("ngram") else k_layers)
                    tokens += count * (min(accepted, used) + 1)
                    drafting = 0.0 if source.startswith("ngram") else used * draft_step
                    seconds += count * (drafting + verify_cost(gpu["verify"], used + 1)) * gpu["step"]
                speed = tokens / seconds
                if best is None or speed > best[1] * (1 + 1e-9):
                    best = ((k_ngram, k_layers), speed, tokens / sum(r[3] for r in rounds))
        (k_ngram, k_layers), speed, per_pass = best
        print(f"PROJECTION {name}: k={k_ngram} for n-gram rounds, k={k_layers} for layer rounds, {per_pass:.2f} tokens "
              f"per pass, {speed * baseline:.2f}x {baseline_name}, {speed * plain:.2f}x selfspec plain {FAST} "
              "(target for the default plan: >= 2x HF static+compile)", flush=True)


def pass_projection(measured: dict) -> None:
    """Speed per plan from a CPU run's passes by width, its policy deciding with the flat profile (tokens per pass
    hold on any machine whose costs are flat so far), priced at this GPU's pass costs: a PROJECTION.

    `benchmarks/data/flat_passes_smollm2.json` holds the run (`python -m benchmarks.report RUN/bench.json
    --passes-out ...`). A verify pass costs its bucket's measured time; a layer draft its weights read (the run's
    steps read beyond one per pass) at this GPU's cost of the deepest draft step per step of weights it reads; the
    per-token overhead of selfspec's plain path carries over as it is.
    """
    data, gpu = projection_inputs("flat_passes_smollm2.json", measured, "PASS PROJECTION")
    if data is None:
        return
    layers, per_token = gpu["layers"], gpu["per_token"]
    baseline_name = "HF static+compile" if "HF static+compile" in per_token else "model.generate"
    plain = per_token[f"selfspec plain {FAST}"]
    deepest = max(gpu["draft"])
    per_step_read = gpu["draft"][deepest] / (deepest / layers)  # a drafted token's cost per step of weights it reads
    print(f"PASS PROJECTION (not a measurement): passes from {data['header']['command']} "
          f"({data['header']['cpu capability']}), priced at this GPU's pass costs; against {baseline_name}.")
    for method, p in data["methods"].items():
        verify = sum(n * verify_cost(gpu["verify"], int(q)) for q, n in p["widths"].items())
        drafting = max(0.0, p["steps_read"] - p["rounds"] - p["prompts"]) * per_step_read
        steps = p["prompts"] + verify + drafting  # in plain steps; a prefill counts as one
        over_plain = p["new_tokens"] / steps
        print(f"PASS PROJECTION {method}: {p['tokens_per_pass']:.2f} tokens per pass, {over_plain:.2f}x selfspec "
              f"plain {FAST}, {over_plain * per_token[baseline_name] / plain:.2f}x {baseline_name} "
              "(target for the default plan: >= 2x)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="GPU checks and timings (see the module docstring)")
    parser.add_argument("--quick", action="store_true", help="two architectures, one shape, no compile: a dry run")
    args = parser.parse_args()
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    began = time.perf_counter()
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}, fast step: {FAST}")
    archs = ["llama", "gemma3_text"] if args.quick else sorted(TINY_CONFIGS)
    greedy = check_greedy(archs)
    sampling = check_sampling()
    offload = check_offload()
    batch = check_batch(archs)
    print(f"checks done in {time.perf_counter() - began:.0f} s", flush=True)
    measured = {}
    for shape in (["SmolLM2-135M"] if args.quick else SHAPES):
        try:
            measured[shape] = costs(shape, args.quick)
        except Exception as error:
            print(f"{shape}: timing raised {type(error).__name__}: {error}", flush=True)
    projection(measured)
    pass_projection(measured)
    try:
        batch_throughput("SmolLM2-135M")
    except Exception as error:
        print(f"batch timing raised {type(error).__name__}: {error}", flush=True)
    if DEVICE.type == "cuda":
        try:
            offload_timing()
        except Exception as error:
            print(f"offload timing raised {type(error).__name__}: {error}", flush=True)
    print(f"RESULT: float64 greedy exact on {DEVICE.type} (eager and {FAST}): {greedy}; seeded sampling reproduces: "
          f"{sampling}; offloaded layers identical: {offload}; batch rows identical: {batch}; "
          f"{time.perf_counter() - began:.0f} s")
    return 0 if greedy and sampling and batch and offload is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
