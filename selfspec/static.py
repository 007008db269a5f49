"""The static step: fixed shapes over the one cache, and CUDA graphs where there is CUDA.

`StaticRunner` is `LayerRunner` with every shape fixed. A pass over q <=
`largest` tokens runs at its bucket, the smallest power of two >= q, with zero
rows appended (their entries lie past the valid ones, unseen by real queries).
`StaticKVCache` writes at positions held on the device. Attention covers the
positions in use rounded up, under a mask built on the device: to a multiple
of `SPAN_STEP` uncaptured, to a power of two from `CAPTURED_SPAN_MIN` when
captured, so a few spans serve every length and a pass reads at most twice the
entries in use.

So `GraphedRunner` can capture one CUDA graph per (layer set, width, span) at
first use and replay it. The host knows every length: no device reads.

This module does not know plans, acceptance or the decode loop
(`rounds.py`).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from .cache import StaticKVCache
from .parts import ModelParts
from .runner import LayerRunner
from .tree import TokenTree

SPAN_STEP = 64  # uncaptured passes attend to the used positions, rounded up to a multiple of this
CAPTURED_SPAN_MIN = 256  # captured passes attend to 256, 512, 1024, ... positions (up to the capacity)
MAX_GRAPHS = 128  # captured passes per runner (layer sets x widths x spans); past it, passes run uncaptured
MAX_CAPTURE_SECONDS = 120.0  # total capture time per runner; past it, passes run uncaptured


def bucket(q: int, largest: int) -> int:
    """The width a pass over q tokens runs at: the smallest power of two >= q, or q past `largest`."""
    if q > largest:
        return q
    return 1 << (q - 1).bit_length()


def largest_bucket(max_width: int) -> int:
    """The widest padded pass for verify passes of up to `max_width` tokens (at least 16: n-gram rounds)."""
    return bucket(max(max_width, 16), 1 << 30)


class StaticRunner(LayerRunner):
    """A `LayerRunner` whose passes have fixed shapes (see the module docstring)."""

    cache_class = StaticKVCache
    drafts_on_device = True  # a round keeps its choices on the device and reads them back once (`rounds.py`)

    def __init__(self, parts: ModelParts, *, capacity: int, max_width: int, device=None, head=None):
        self.largest = largest_bucket(max_width)
        # Room for the padded rows of a pass that starts at the last valid position.
        super().__init__(parts, capacity=capacity + self.largest, device=device, head=head)
        device = self.positions.device
        self.valid_capacity = capacity
        self.offsets = torch.arange(self.largest, device=device)  # [largest]
        self.key_positions = self.positions[0]  # [capacity]

    def run(self, hidden: torch.Tensor, layers, start: int, tree: TokenTree | None = None, *, probe=None) -> torch.Tensor:
        """Run `layers` on `hidden` `[1, q, hidden]` at positions start..start+q-1, padded to its bucket.

        With a `tree` (`tree.py`), row r is written at slot start + r, sits at
        start + its depth and sees the prefix and its ancestors. `probe`: as
        `LayerRunner.run`'s (it sees the q real rows; such a pass is not captured).
        """
        layers = tuple(layers)
        q = hidden.shape[1]
        if not layers:
            return hidden
        for i in layers:
            if self.cache.lengths[i] != start:
                raise RuntimeError(
                    f"cache out of step: layer {i} holds {self.cache.lengths[i]} positions, expected {start}"
                )
        if start + q > self.valid_capacity:
            raise RuntimeError(f"KV cache overflow: {start + q} positions > capacity {self.valid_capacity}")
        width = bucket(q, self.largest)
        if width > q:
            hidden = F.pad(hidden, (0, 0, 0, width - q))  # [1, width, hidden], zero rows after the real ones
        self.weights_read += sum(self.layer_bytes[i] for i in layers)
        real_rows = None if probe is None else (lambda i, before, after: probe(i, before[:, :q], after[:, :q]))
        out = self.fixed_pass(hidden, layers, start, self.tree_rows(tree, start, width), probe=real_rows)  # [1, width, hidden]
        for i in layers:
            self.cache.lengths[i] = start + q
        return out[:, :q]

    def tree_rows(self, tree: TokenTree | None, start: int, width: int):
        """For a tree pass: (`[width]` positions of the rows, `[width, width]` which rows each row sees); else None.

        Padded rows sit at their slots and see only the prefix and themselves.
        """
        if tree is None:
            return None
        device = self.offsets.device
        q = len(tree) + 1
        depths = torch.tensor(tree.depths() + list(range(q, width)), device=device)  # [width]
        visible = torch.eye(width, dtype=torch.bool, device=device)  # [width, width]
        visible[:q, :q] = tree.visibility().to(device)
        return start + depths, visible

    def fixed_pass(self, hidden: torch.Tensor, layers: tuple[int, ...], start, tree_rows=None, probe=None,
                   span: int | None = None) -> torch.Tensor:
        """`layers` on `hidden` `[1, width, hidden]` at start..start+width-1; `start` an int or a 0-d device tensor.

        `tree_rows` (`tree_rows()`): the rows' positions and visibility of a tree pass.
        `probe(layer, before, after)`: called after each layer (`auto_layers.py`).
        `span`: the positions attention covers (at least start + width); by default `span()`'s.
        """
        width = hidden.shape[1]
        if width <= self.largest:
            slots = self.offsets[:width] + start  # [width], on the device
        else:  # a wide prefill: a plain range
            slots = torch.arange(start, start + width, device=self.offsets.device)
        positions = slots if tree_rows is None else tree_rows[0]  # [width]: where each row sits
        self.cache.write_positions = slots
        self.cache.span = self.span(start, width) if span is None else span
        rotary = {kind: (cos[:, positions], sin[:, positions]) for kind, (cos, sin) in self.rotary.items()}

        def mask_for(window: int | None) -> torch.Tensor:
            if tree_rows is None:
                return self.capacity_mask(positions, window)
            return self.tree_capacity_mask(start, *tree_rows, window)

        return self.run_layers(hidden, layers, mask_for=mask_for, rotary=rotary, position_ids=positions[None],
                               probe=probe)

    def span(self, start, width: int) -> int:
        """How many cache positions a pass attends to: those in use, rounded up (all of them when captured)."""
        if isinstance(start, torch.Tensor):  # the start is not known on the host: every position
            return self.cache.capacity
        return min(self.cache.capacity, -(-(start + width) // SPAN_STEP) * SPAN_STEP)

    def captured_span(self, end: int) -> int:
        """The span a captured pass ending at `end` runs at: the smallest `CAPTURED_SPAN_MIN` * 2^i >= end."""
        span = CAPTURED_SPAN_MIN
        while span < end:
            span *= 2
        return min(span, self.cache.capacity)

    def tree_capacity_mask(self, start, rows: torch.Tensor, visible: torch.Tensor, window: int | None):
        """`[1, 1, width, span]` mask of a tree pass: the prefix, then the slots each row sees.

        Built on the device from `start` (an int or a 0-d tensor), so a tree pass can be captured too.
        """
        width = rows.shape[0]
        slots = self.key_positions[: self.cache.span]  # [span]: slot indices
        relative = slots - start  # [span]: the row a slot holds, if 0 <= it < width
        inside = (relative >= 0) & (relative < width)
        row_of = relative.clamp(0, width - 1)
        allowed = (relative < 0)[None] | (inside[None] & visible[:, row_of])  # [width, span]
        if window is not None:
            key_pos = torch.where(inside, rows[row_of], slots)  # [span]: a slot's position is its row's
            allowed &= key_pos[None] > rows[:, None] - window
        return self.as_mask(allowed)

    def capacity_mask(self, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """`[1, 1, width, span]` mask: query at p sees keys k <= p (and p - k < window)."""
        query = positions[:, None]  # [width, 1]
        key = self.key_positions[None, : self.cache.span]  # [1, span]
        allowed = key <= query
        if window is not None:
            allowed &= key > query - window
        return self.as_mask(allowed)


class CapturedPass:
    """One CUDA graph: its input buffers, its output, and the graph to replay.

    The buffers are the hidden states `[1, width, hidden]`, the first slot
    (0-d int64) and, for a tree pass, the rows' positions `[width]` and
    visibility `[width, width]`: a replay copies the call's values into them.
    """

    def __init__(self, graph, buffers: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        self.graph = graph
        self.buffers = buffers
        self.output = output  # [1, width, hidden]: valid after a replay, until the next one

    def replay(self, *values) -> torch.Tensor:
        for buffer, value in zip(self.buffers, values):
            if isinstance(value, torch.Tensor):
                buffer.copy_(value)
            else:
                buffer.fill_(value)
        self.graph.replay()
        return self.output.clone()  # the next replay overwrites the output


class CudaGraphBackend:
    """What `GraphedRunner` asks of CUDA: a side stream to warm up on, a capture, a wait.

    Kept apart so the runner's bookkeeping (which pass is captured, its input
    buffers, its replays) can be tested on a CPU with a stand-in that runs the
    recorded function again at each replay.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device}")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs replay one at a time

    @contextlib.contextmanager
    def warm_up(self):
        """Run a pass once on a side stream before capturing it, as capture requires."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(side)

    def record(self, fn):
        """(graph, output): `fn`'s kernels captured, not run; `graph.replay()` runs them, writing `output`."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph, output

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class GraphedRunner(StaticRunner):
    """A `StaticRunner` that captures each (layer set, width, span) pass as a CUDA graph on first use.

    The graphs hold the addresses of this runner's cache, so the runner lives
    as long as the wrapped model uses it (the engine keeps one and reuses it
    for every generation that fits its capacity). A pass that fails to capture
    turns graphs off for the runner and says why in `graph_error`; the passes
    then run uncaptured, with the same result.
    """

    def __init__(self, parts: ModelParts, *, capacity: int, max_width: int, device=None, head=None):
        super().__init__(parts, capacity=capacity, max_width=max_width, device=device, head=head)
        self.backend = CudaGraphBackend(self.positions.device)
        self.graphs: dict[tuple, CapturedPass] = {}
        self.capture_seconds = 0.0
        self.graph_error: str | None = None

    def fixed_pass(self, hidden: torch.Tensor, layers: tuple[int, ...], start, tree_rows=None, probe=None) -> torch.Tensor:
        width = hidden.shape[1]
        # Inside a capture, a wide prefill, or a pass whose layers report to a probe: uncaptured.
        if isinstance(start, torch.Tensor) or width > self.largest or probe is not None:
            return super().fixed_pass(hidden, layers, start, tree_rows, probe)
        key = (layers, width, tree_rows is not None, self.captured_span(start + width))
        captured = self.graphs.get(key)
        if captured is not None:
            return captured.replay(hidden, start, *(tree_rows or ()))
        if self.graph_error is not None or len(self.graphs) >= MAX_GRAPHS or self.capture_seconds > MAX_CAPTURE_SECONDS:
            return super().fixed_pass(hidden, layers, start, tree_rows)
        return self.capture(key, hidden, start, tree_rows)

    def capture(self, key: tuple, hidden: torch.Tensor, start: int, tree_rows=None) -> torch.Tensor:
        """Run the pass (its result is this call's), then record it as a graph for the next calls."""
        layers, span = key[0], key[3]
        began = time.perf_counter()
        static_hidden = hidden.clone()  # [1, width, hidden]: the graph's input buffer
        static_start = torch.tensor(start, device=hidden.device)  # 0-d: the graph's first slot
        static_tree = None if tree_rows is None else tuple(t.clone() for t in tree_rows)  # rows' positions, visibility

        def run() -> torch.Tensor:
            return StaticRunner.fixed_pass(self, static_hidden, layers, static_start, static_tree, span=span)

        with self.backend.warm_up():  # the real pass: this call's result
            result = run().clone()
        try:
            graph, output = self.backend.record(run)
        except Exception as error:  # noqa: BLE001 -- an architecture or processor that cannot be captured
            self.graph_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            self.backend.synchronize()
            return result
        self.graphs[key] = CapturedPass(graph, (static_hidden, static_start, *(static_tree or ())), output)
        self.backend.synchronize()
        self.capture_seconds += time.perf_counter() - began
        return result

    def describe(self) -> str:
        if self.graph_error is not None:
            return f"static, CUDA graphs off ({self.graph_error})"
        return f"CUDA graphs ({len(self.graphs)} captured in {self.capture_seconds:.2f} s)"
