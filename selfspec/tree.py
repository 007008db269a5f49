"""Token trees: several drafted continuations verified in one pass over the shared cache.

A tree hangs under the last emitted token x (row 0 of the verify pass). Node
i (row i + 1) holds a drafted token and its parent (-1 for x). Each row writes
its cache entries at its own slot (start + row) but sits at its depth's
position (start + depth) and sees the verified prefix and its ancestors only.

Greedy keeps the longest path the target agrees with. Sampling (SpecInfer's
rule for deterministic drafts)
tries a reached node's children in order, the j-th accepted with probability
p(t_j) / (1 - the earlier siblings' p), and when all fail samples from p
without their tokens: exact. `compact` moves the kept path's entries into
place (O(accepted x layers) copies) and crops the rest.

`LayerTreeGrowth` keeps a layer draft's tree as it grows, level by level,
from the draft's probabilities (one sequence's and a batch row's alike). It
does not run layers, nor decide how deep or wide a round drafts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]  # node i's token
    parents: tuple[int, ...]  # node i's parent: -1 for the root x, else j < i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents come before their children (or -1, the root)")

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> TokenTree:
        """The tree of one path: each token under the one before it."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths: list[list[int]], *, max_nodes: int) -> TokenTree:
        """The trie of `paths` (shared prefixes merged), in order, cut at `max_nodes` nodes."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for path in paths:
            parent = -1
            for token in path:
                node = children.get((parent, token))
                if node is None:
                    if len(tokens) == max_nodes:
                        break
                    node = children[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = node
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of every row: 0 for the root x, 1 + the parent's for a node."""
        return list(self._depths)

    def visibility(self) -> torch.Tensor:
        """`[n+1, n+1]` bool: row r sees row c iff c is r or one of its ancestors (row 0 is the root)."""
        return self._visibility.clone()

    # Computed once per tree: a round's passes (embedding, each run of layers, each mask) all ask.
    @functools.cached_property
    def _depths(self) -> tuple[int, ...]:
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent + 1] + 1)
        return tuple(depths)

    @functools.cached_property
    def _visibility(self) -> torch.Tensor:
        n = len(self.tokens)
        rows = [[True] + [False] * n]  # built on the host, one tensor at the end (not a tensor op per node)
        for i, parent in enumerate(self.parents):
            row = rows[parent + 1].copy()
            row[i + 1] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool)

    @functools.cached_property
    def _earlier_siblings(self) -> torch.Tensor:
        """`[n, n]` float: [i, j] = 1 iff node j is a sibling of node i that comes before it."""
        n = len(self.tokens)
        earlier = torch.zeros(n, n)
        for i, parent in enumerate(self.parents):
            for j in range(i):
                if self.parents[j] == parent:
                    earlier[i, j] = 1.0
        return earlier

    def first_path_kept(self, path: list[int]) -> int:
        """How many tokens of the first path (nodes 0, 1, ...: `from_paths` puts it first) `path` kept."""
        return next((i for i, node in enumerate(path) if node != i), len(path))

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[i] for i in path]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for the root, -1)."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


class LayerTreeGrowth:
    """A layer draft's tree as it grows (EAGLE-2's expansion), one level a draft pass; one sequence's or a batch row's.

    Each proposal is (the draft's probability of the path to it, its parent
    proposal or -1 for the last token, its token, its depth). A level is the
    `branches` likeliest proposals not run yet; each pass runs the level's
    nodes (`run_level`), and `expand` gives each of them its `branches`
    likeliest next tokens. `tree` picks the nodes a round verifies.
    """

    def __init__(self, branches: int) -> None:
        self.branches = branches
        self.proposals: list[tuple[float, int, int, int]] = []
        self.ran: list[int] = []  # the proposals the passes ran, in their tree rows (1..; row 0 is the last token)
        self.level: list[int] = [-1]  # the proposals the next pass runs (-1: the last token)
        self.parent_slots: list[int] = [0]  # per level node: its parent's place in the level before
        self.pass_widths: list[int] = []  # per pass expanded: the nodes it ran (how its draft pass is priced)

    @property
    def depth(self) -> int:
        """Levels expanded so far."""
        return self.proposals[-1][3] if self.proposals else 0

    def lineage(self, node: int) -> list[int]:
        """The tokens on the path from the root down to proposal `node` (empty for -1, the last token)."""
        path = []
        while node >= 0:
            path.append(self.proposals[node][2])
            node = self.proposals[node][1]
        return path[::-1]

    def run_level(self) -> tuple[TokenTree, int, list[int]]:
        """The next level joins the rows run: (the tree of every row run, the level's first row, its tokens)."""
        first_row = len(self.ran) + 1
        self.ran += self.level
        at = {node: row for row, node in enumerate(self.ran)}
        grown = TokenTree(tuple(self.proposals[i][2] for i in self.ran),
                          tuple(-1 if self.proposals[i][1] < 0 else at[self.proposals[i][1]] for i in self.ran))
        return grown, first_row, [self.proposals[i][2] for i in self.level]

    def expand(self, logits: torch.Tensor) -> float:
        """The level's draft logits `[w, vocab]` (row j: after level node j): each node's likeliest next tokens
        become proposals, the likeliest `branches` of them the next level. Returns the share of the level's
        probability the next level keeps."""
        top_p, top_tokens = torch.softmax(logits.float(), dim=-1).topk(self.branches)  # [w, b]
        self.pass_widths.append(len(self.level))
        reach = [1.0 if node < 0 else self.proposals[node][0] for node in self.level]
        depth = self.depth + 1
        children, slots = [], {}
        for j, node in enumerate(self.level):
            for p, token in zip(top_p[j].tolist(), top_tokens[j].tolist()):
                slots[len(self.proposals)] = j
                children.append(len(self.proposals))
                self.proposals.append((reach[j] * p, node, token, depth))
        self.level = sorted(children, key=lambda c: -self.proposals[c][0])[: self.branches]
        self.parent_slots = [slots[c] for c in self.level]
        return sum(self.proposals[c][0] for c in self.level) / sum(reach)

    def best_path(self, max_depth: int | None = None) -> list[int]:
        """The proposals on the likeliest path among the deepest (at most `max_depth` deep), root first."""
        candidates = [c for c, item in enumerate(self.proposals) if max_depth is None or item[3] <= max_depth]
        if not candidates:
            return []
        node = max(candidates, key=lambda c: (self.proposals[c][3], self.proposals[c][0]))
        path = []
        while node >= 0:
            path.append(node)
            node = self.proposals[node][1]
        return path[::-1]

    def tree(self, nodes: int, max_depth: int | None = None) -> tuple[TokenTree, tuple[float, ...]]:
        """The `nodes` likeliest proposals (at most `max_depth` deep), the likeliest deepest path first, as a
        tree, and per node its path probability. A parent is likelier than its child, so any first m nodes
        form a tree too."""
        best = self.best_path(max_depth)
        chosen = sorted((c for c, item in enumerate(self.proposals) if max_depth is None or item[3] <= max_depth),
                        key=lambda c: (-self.proposals[c][0], c))[:nodes]
        on_best = set(best)
        order = best + [c for c in chosen if c not in on_best]
        tree = TokenTree.from_paths([self.lineage(best[-1])] + [self.lineage(c) for c in order[len(best):]],
                                    max_nodes=max(nodes, len(best)))
        return tree, tuple(self.proposals[c][0] for c in order[: len(tree)])


def accept_tree_greedy(tree: TokenTree, target_scores: torch.Tensor) -> tuple[list[int], int]:
    """The longest path the target agrees with (node indices) and the target's next token after it.

    `target_scores` `[n+1, vocab]`: row r scores the token after row r (`accept_tree_greedy_on_device`, read back).
    """
    return read_path(*accept_tree_greedy_on_device(tree, target_scores))


def accept_tree_sampling(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """The kept path (node indices) and the next token, by recursive rejection (module docstring).

    `target_probs` p `[n+1, vocab]`: row r is the target's distribution after row r.
    """
    return read_path(*accept_tree_sampling_on_device(tree, target_probs, generator))


def read_path(kept: torch.Tensor, next_token: torch.Tensor) -> tuple[list[int], int]:
    """A device rule's (kept `[n]` bool, next token `[1]`) read back: the kept path's nodes, the next token."""
    values = torch.cat([kept.long(), next_token.view(1)]).tolist()
    return [node for node, keep in enumerate(values[:-1]) if keep], values[-1]


def accept_tree_sampling_on_device(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_tree_sampling` without a read back: (kept `[n]` bool, the next token `[1]`), on the device.

    Every node draws its uniform u up front; node i "passes" when
    u_i (1 - S_i) < p(t_i | parent), S_i being its earlier siblings' mass, and is
    chosen when it passes and no earlier sibling did. A node is kept when it
    and all its ancestors are chosen; at the deepest kept node (or the root)
    every child was tried and rejected, so the next token comes from that row
    of p with the children's tokens removed.
    """
    device = target_probs.device
    n = len(tree)
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=device), torch.multinomial(
            target_probs[0].float(), 1, generator=generator)
    p = target_probs.double()  # [n+1, vocab]
    tokens = torch.tensor(tree.tokens, device=device)  # [n]
    parent_rows = torch.tensor(tree.parents, device=device) + 1  # [n]
    earlier = tree._earlier_siblings.to(device=device, dtype=torch.float64)  # [n, n]
    p_token = p[parent_rows, tokens]  # [n]: p(t_i | parent)
    remaining = (1.0 - earlier @ p_token).clamp_min(0.0)  # [n]: mass left when node i is tried
    u = torch.rand(n, generator=generator, device=device, dtype=torch.float64)  # [n]
    passes = u * remaining < p_token  # [n]
    chosen = passes & ((earlier @ passes.double()) == 0)  # [n]
    lineage = tree.visibility()[1:, 1:].to(device=device, dtype=torch.float64)  # [n, n]: self and ancestors
    kept = (lineage @ (~chosen).double()) == 0  # [n]
    depths = torch.tensor(tree.depths()[1:], device=device)  # [n]
    deepest = torch.argmax(kept.long() * depths)  # 0-d
    row = torch.where(kept.any(), deepest + 1, torch.zeros_like(deepest))  # 0-d: the row the next token follows
    p_row = p.index_select(0, row.view(1))[0]  # [vocab]
    is_child = (parent_rows == row).double()  # [n]: the row's children, all rejected
    removed = torch.zeros_like(p_row).index_add_(0, tokens, is_child)  # [vocab]: > 0 at a child's token
    residual = p_row.masked_fill(removed > 0, 0.0)  # [vocab]
    residual = torch.where(residual.sum() > 0, residual, p_row)  # the children held all the mass, up to rounding
    return kept, torch.multinomial(residual.float(), 1, generator=generator)


def move_path(buffers, *, start: int, path: list[int], row: int | slice = slice(None)) -> None:
    """Move the accepted path's entries (rows path[i] + 1, at slots start + 1 + path[i]) to start + 1 + i in each
    of `buffers` `[rows, heads, capacity, dim]` (None skipped), in row `row` of them (every row by default).

    Copies only `len(path)` positions per buffer; the root's entries (row 0) are
    already at `start`. A row's slot is never before its position, so reading
    all sources before writing (advanced indexing gathers a copy) is safe.
    """
    if all(node == i for i, node in enumerate(path)):  # already in place (or empty)
        return
    source = None  # [len(path)] slots to read, on the buffers' device: one copy there, not one per buffer
    for buffer in buffers:
        if buffer is not None:
            if source is None or source.device != buffer.device:
                source = torch.tensor([start + 1 + node for node in path], device=buffer.device)
            buffer[row, :, start + 1 : start + 1 + len(path)] = buffer[row, :, source]


def compact(cache, *, start: int, path: list[int], layers) -> None:
    """One sequence's cache after a tree's verify pass: `move_path` in `layers`, then crop after the path."""
    move_path([b for i in layers for b in (cache.keys[i], cache.values[i])], start=start, path=path)
    cache.crop(start + 1 + len(path))


def accept_tree_greedy_on_device(tree: TokenTree, target_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_tree_greedy` without a read back: (kept `[n]` bool, the next token `[1]`), on the device.

    A node is kept when its token is the target's choice after its parent and
    the same holds for all its ancestors; siblings hold different tokens, so
    the kept nodes form one path, and the next token follows its deepest node.
    """
    device = target_scores.device
    n = len(tree)
    choices = target_scores.argmax(dim=-1)  # [n+1]
    tokens = torch.tensor(tree.tokens, device=device)  # [n]
    parent_rows = torch.tensor(tree.parents, device=device) + 1  # [n]
    lineage = tree.visibility()[1:, 1:].to(device=device, dtype=torch.float32)  # [n, n]: self and ancestors
    wrong = (tokens != choices[parent_rows]).float()  # [n]
    kept = (lineage @ wrong) == 0  # [n]
    depths = torch.tensor(tree.depths()[1:], device=device)  # [n]
    deepest = torch.argmax(kept.long() * depths)  # 0-d: a node index (meaningless when nothing is kept)
    row = torch.where(kept.any(), deepest + 1, torch.zeros_like(deepest))  # 0-d: the row the next token follows
    return kept, choices.index_select(0, row.view(1)) if n else choices[:1]
