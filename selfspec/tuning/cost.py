"""The measured cost model: layers, LM head and verify passes as fractions of one plain decoding step.

`measure_cost_model` times them on this machine, in the model's dtype; the
i.i.d. formulas (Leviathan et al.) turn an agreement rate into an expected
speedup. It knows nothing about which layers a draft runs or how well they
agree with the target, and nothing about the machine beyond what it times.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..parts import text_config
from ..registry import model_parts
from ..runner import LayerRunner


@dataclass(frozen=True)
class CostModel:
    """Measured costs, as fractions of one plain decoding step (one token through the full model).

    `layer[q-1]`, `head[q-1]`: one layer, and the final norm + LM head, on q
    tokens. `overhead`: the rest of a forward pass (embedding, argmax, Python),
    so that `overhead + L * layer[0] + head[0] == 1`.
    """

    num_layers: int
    layer: tuple[float, ...]
    head: tuple[float, ...]
    overhead: float
    plain_step_seconds: float = 0.0
    dtype: str = ""
    threads: int = 0

    @property
    def max_draft_length(self) -> int:
        return min(len(self.layer), len(self.head)) - 1

    def draft_step(self, num_draft_layers: int) -> float:
        """One drafted token through `num_draft_layers` layers and the LM head."""
        return self.overhead + num_draft_layers * self.layer[0] + self.head[0]

    def verify(self, drafted: int, exact_prefix: int = 0) -> float:
        """One verify pass over the last token and `drafted` tokens, resuming after the plan's exact prefix.

        The draft already ran layers 0..s-1 for all but the last drafted token,
        so those layers see one token; the other L - s layers see drafted + 1.
        """
        q = min(drafted, self.max_draft_length) + 1
        s = exact_prefix if drafted else 0
        return self.overhead + s * self.layer[0] + (self.num_layers - s) * self.layer[q - 1] + self.head[q - 1]

    def round_cost(self, drafted: int, num_draft_layers: int, exact_prefix: int) -> float:
        return drafted * self.draft_step(num_draft_layers) + self.verify(drafted, exact_prefix)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["verify_full"] = [self.verify(k) for k in range(self.max_draft_length + 1)]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["layer"], values["head"] = tuple(values["layer"]), tuple(values["head"])
        return cls(**values)

    def summary(self) -> str:
        verify = ", ".join(f"{k}: {self.verify(k):.2f}" for k in range(1, self.max_draft_length + 1))
        return (
            f"plain step {self.plain_step_seconds * 1e3:.1f} ms ({self.dtype}, {self.threads} threads); "
            f"in plain steps: one layer {self.layer[0]:.4f} (all {self.num_layers}: "
            f"{self.num_layers * self.layer[0]:.2f}), LM head {self.head[0]:.3f}, overhead {self.overhead:.3f}; "
            f"verify(k) {verify}"
        )


@torch.no_grad()
def measure_cost_model(
    model, *, max_draft_length: int = 8, context: int = 64, repeats: int = 15, progress: bool = True
) -> CostModel:
    """Time the layers, the LM head and a plain step on this machine, in the model's dtype.

    Every measurement is repeated `repeats` times, all kinds interleaved (so a
    burst of load on a shared machine hits them alike), after a warmup; the
    medians are used. A `context` of earlier tokens sits in the cache.
    """
    parts = model_parts(model)
    num_layers = parts.num_layers
    device = parts.lm_head.weight.device
    q_max = max_draft_length + 1
    runner = LayerRunner(parts, capacity=context + q_max + 1, device=device)
    ids = torch.randint(0, _vocab_size(model), (context + q_max,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.run(runner.embed(ids[:context], 0), range(num_layers), 0)
    inputs = {q: runner.embed(ids[context : context + q], context) for q in range(1, q_max + 1)}

    def stack(q: int) -> Callable[[], None]:
        def run() -> None:
            runner.run(inputs[q], range(num_layers), context)
            runner.cache.crop(context)

        return run

    def head(q: int) -> Callable[[], None]:
        return lambda: runner.logits(inputs[q])

    def plain() -> None:
        hidden = runner.run(runner.embed(ids[context : context + 1], context), range(num_layers), context)
        int(runner.logits(hidden[:, -1:])[0].argmax())
        runner.cache.crop(context)

    tasks: dict[Any, Callable[[], None]] = {"plain": plain}
    tasks.update({("stack", q): stack(q) for q in range(1, q_max + 1)})
    tasks.update({("head", q): head(q) for q in range(1, q_max + 1)})
    times: dict[Any, list[float]] = {name: [] for name in tasks}
    for fn in tasks.values():  # warmup
        fn()
        fn()
    for _ in tqdm(range(repeats), desc="cost model", disable=not progress, leave=False):
        for name, fn in tasks.items():
            _sync(device)
            began = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - began)
    median = {name: statistics.median(values) for name, values in times.items()}
    step = median["plain"]
    layer = tuple(median[("stack", q)] / num_layers / step for q in range(1, q_max + 1))
    head_cost = tuple(median[("head", q)] / step for q in range(1, q_max + 1))
    return CostModel(
        num_layers=num_layers,
        layer=layer,
        head=head_cost,
        overhead=max(0.0, 1.0 - num_layers * layer[0] - head_cost[0]),
        plain_step_seconds=step,
        dtype=str(parts.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _vocab_size(model) -> int:
    return int(text_config(model.config).vocab_size)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Tokens emitted per round with k drafted tokens, each accepted i.i.d. with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def iid_speedup(alpha: float, k: int, *, draft_step: float, verify: float) -> float:
    """Leviathan et al.'s expected speedup: tokens per round over the round's cost in plain steps."""
    return expected_tokens_per_round(alpha, k) / (k * draft_step + verify)
