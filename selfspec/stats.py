"""What one generation did, measured: drafted, accepted, tokens per pass, time.

Counting rules (the words are those of docs/how-it-works.md):
- a *verify pass* is one forward pass of the full model; the prompt's prefill
  counts as one (it emits the first new token), so plain decoding reports
  exactly 1.00 tokens per pass;
- `accepted_lengths[n]` counts the rounds that accepted n drafted tokens;
- emitted tokens stop at EOS, a stopping criterion or `max_new_tokens`, so a
  round may emit fewer tokens than it verified;
- `steps_read` is the weights the passes read (layers, LM head, draft
  vocabulary rows) in plain steps: plain decoding reads exactly one per
  token, the prefill included. `tokens_per_step_read` is the speed over plain
  decoding where a pass costs only the weights it reads: a projection, not a
  timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    new_tokens: int = 0
    rounds: int = 0
    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    ngram_drafted: int = 0  # of `drafted`, copied from an earlier n-gram match
    ngram_accepted: int = 0  # of `accepted`, those copied tokens
    tree_rounds: int = 0  # rounds that verified a token tree (n-gram continuations or a branching layer draft;
    # `drafted` counts its nodes)
    layer_tree_rounds: int = 0  # of `tree_rounds`, those of layer drafts
    tree_nodes: int = 0  # nodes those trees held
    tree_accepted: int = 0  # tokens kept from them (the accepted path)
    recycled_drafted: int = 0  # recycled nodes verified (`recycle.py`)
    recycled_accepted: int = 0  # of them, those on kept paths
    recycling_paused: int = 0  # rounds that neither recorded nor drafted recycled nodes: they did not pay
    rounds_without_draft: int = 0  # plain steps: drafting off, paused, or no budget left
    accepted_lengths: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt positions taken from the prefix cache instead of prefilled (`prefix_cache.py`)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    plan: str = ""
    policy: str = ""  # the draft-length policy and what it learned
    costs: str = ""  # the cost table the policy decided with (cost policy only)
    drafted_lengths: list[int] = field(default_factory=list)  # drafted_lengths[k]: rounds that drafted k tokens
    round_outcomes: dict[str, int] = field(default_factory=dict)  # "source k n": rounds that drafted k, accepted n
    final_threshold: float | None = None
    step: str = ""  # how passes ran: "eager", "static", or CUDA graphs (with how many, and their capture time)
    capture_seconds: float = 0.0  # CUDA graph capture in this call (0 once the graphs exist)
    layer_sets: str = ""  # an auto plan: the layer sets it drafted with, and the round each began at
    steps_read: float = 0.0  # the weights every pass read, in plain steps (one reads each layer and the LM head)
    streamed_bytes: int = 0  # offloaded layers' bytes selfspec read into its slots (`streaming.py`)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def layer_drafted(self) -> int:
        return self.drafted - self.ngram_drafted - self.recycled_drafted

    @property
    def layer_accepted(self) -> int:
        return self.accepted - self.ngram_accepted - self.recycled_accepted

    def by_source(self) -> dict[str, tuple[int, int]]:
        """(drafted, accepted) tokens per draft source: "layers" (layers and exit heads), "ngram", "recycled"."""
        return {"layers": (self.layer_drafted, self.layer_accepted),
                "ngram": (self.ngram_drafted, self.ngram_accepted),
                "recycled": (self.recycled_drafted, self.recycled_accepted)}

    @property
    def tokens_per_pass(self) -> float:
        """Emitted tokens per full forward pass (tau); 1.00 for plain decoding."""
        return self.new_tokens / self.verify_passes if self.verify_passes else 0.0

    @property
    def tokens_per_step_read(self) -> float:
        """Emitted tokens per plain step of weights read: the speed over plain decoding where a pass costs what it
        reads (a projection; 1.00 for plain decoding)."""
        return self.new_tokens / self.steps_read if self.steps_read else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def record_round(
        self, *, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float, source: str = "layers",
        recycled: tuple[int, int] = (0, 0),
    ) -> None:
        """One round; `recycled`: of its drafted and accepted tokens, those from recycled nodes."""
        self.rounds += 1
        if source.endswith(" tree"):
            self.tree_rounds += 1
            self.tree_nodes += drafted
            self.tree_accepted += accepted
            self.layer_tree_rounds += source == "layers tree"
        self.recycled_drafted += recycled[0]
        self.recycled_accepted += recycled[1]
        if source in ("ngram", "ngram tree"):
            self.ngram_drafted += drafted - recycled[0]
            self.ngram_accepted += accepted - recycled[1]
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.rounds_without_draft += drafted == 0
        self.verify_passes += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted < drafted:
            self.recovered += 1
        else:
            self.bonus += 1 if drafted else 0
        while len(self.drafted_lengths) <= drafted:
            self.drafted_lengths.append(0)
        self.drafted_lengths[drafted] += 1
        outcome = f"{source} {drafted} {accepted}"
        self.round_outcomes[outcome] = self.round_outcomes.get(outcome, 0) + 1
        while len(self.accepted_lengths) <= accepted:
            self.accepted_lengths.append(0)
        self.accepted_lengths[accepted] += 1

    def as_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items()}
        data.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_pass=self.tokens_per_pass,
            tokens_per_step_read=self.tokens_per_step_read,
            tokens_per_second=self.tokens_per_second,
        )
        return data

    def __str__(self) -> str:
        lines = [
            f"plan: {self.plan}",
            f"new tokens {self.new_tokens} in {self.total_seconds:.2f} s ({self.tokens_per_second:.1f} tok/s)",
            f"verify passes {self.verify_passes} (rounds {self.rounds} + prefill; "
            f"{self.rounds_without_draft} rounds without a draft), "
            f"tokens per pass {self.tokens_per_pass:.2f}",
            *(
                [f"weights read: {self.steps_read:.1f} plain steps, {self.tokens_per_step_read:.2f} tokens per step "
                 f"read (the speed over plain where a pass costs what it reads: a projection)"]
                if self.steps_read else []
            ),
            *(
                [f"offloaded layers streamed: {self.streamed_bytes / 2**20:.1f} MiB, "
                 f"{self.streamed_bytes / 2**20 / max(1, self.new_tokens):.1f} MiB per new token"]
                if self.streamed_bytes else []
            ),
            f"drafted {self.drafted}, accepted {self.accepted}, acceptance rate {self.acceptance_rate:.1%}",
            f"drafted length histogram: {self.drafted_lengths}; accepted length histogram: {self.accepted_lengths}",
            *(
                [f"from n-gram lookup: drafted {self.ngram_drafted}, accepted {self.ngram_accepted}; "
                 f"recycled: drafted {self.recycled_drafted}, accepted {self.recycled_accepted}"
                 f"{f' (paused {self.recycling_paused} rounds)' if self.recycling_paused else ''}; "
                 f"from layers: drafted {self.layer_drafted}, accepted {self.layer_accepted}"]
                if self.ngram_drafted or self.recycled_drafted else []
            ),
            *(
                [f"token trees: {self.tree_rounds} rounds, {self.tree_nodes} nodes verified, "
                 f"{self.tree_accepted} tokens kept ({self.tree_accepted / self.tree_rounds:.2f} per tree round)"]
                if self.tree_rounds else []
            ),
            f"time: prefill {self.prefill_seconds:.3f} s, draft {self.draft_seconds:.3f} s, "
            f"verify {self.verify_seconds:.3f} s",
        ]
        if self.step:
            lines.append(f"step: {self.step}" + (f"; captured graphs in this call: {self.capture_seconds:.2f} s"
                                                 if self.capture_seconds else ""))
        if self.layer_sets:
            lines.append(f"layers chosen (auto): {self.layer_sets}")
        if self.policy:
            lines.append(f"draft length: {self.policy}")
        if self.costs:
            lines.append(f"costs: {self.costs}")
        return "\n".join(lines)


@dataclass
class BatchStats:
    """What a batch did: every row's own `GenerationStats` (in the order rows finished) and the batch's totals.

    A *pass* here is one forward pass of the full model over a block of rows:
    each row's prefill is one, each round is one for all its rows. A row's
    own `verify_passes` counts the passes it took part in, so its
    `tokens_per_pass` is what it would be alone.
    """

    row_stats: list[GenerationStats] = field(default_factory=list)
    passes: int = 0  # forward passes (prefills + rounds)
    rounds: int = 0  # batched rounds
    row_passes: int = 0  # the sum over passes of the rows in each
    draft_passes: int = 0  # layer draft passes, each one drafted token for every row
    resumed_passes: int = 0  # rounds whose verify pass resumed after the layer draft's exact prefix
    streamed_bytes: int = 0  # offloaded layers' bytes selfspec read into its slots (`streaming.py`)
    total_seconds: float = 0.0
    costs: str = ""  # the batched cost table of the last round
    plan: str = ""

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.row_stats)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.row_stats)

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.row_stats)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.row_stats)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Emitted tokens per row-pass: 1.00 for plain decoding, whatever the batch size."""
        return self.new_tokens / self.row_passes if self.row_passes else 0.0

    @property
    def mean_batch(self) -> float:
        """Rows per round, on average."""
        rounds = self.row_passes - len(self.row_stats)  # each row's prefill ran alone
        return rounds / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0
