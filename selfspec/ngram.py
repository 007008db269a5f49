"""N-gram proposals (prompt lookup): draft by copying what followed an earlier match.

When the last n tokens occurred before (in the prompt or the output so far),
what followed that occurrence is a free guess of what comes next: summaries,
RAG answers and code edits repeat their context often, and the guess costs no
model computation. An index of each n-gram's positions grows with the
sequence, so a lookup reads a few entries.

Where the longest suffix (n = max_ngram) occurred several times, the
occurrence that agrees furthest back with the end of the sequence is copied
first, and that match length (measured past max_ngram, up to `MATCH_CAP`
tokens) is returned with the copy: the cost policy keeps its estimates by it.

This module only searches token lists; it knows nothing of models or caches.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, islice

MATCH_CAP = 32  # how far back a match's agreement is measured, in tokens
OCCURRENCES_RANKED = 16  # the latest occurrences of a max_ngram suffix, ranked by how far back they agree


def lookup(tokens: list[int], *, max_ngram: int, budget: int) -> list[int]:
    """Up to `budget` tokens that followed an earlier match of the longest suffix (n <= max_ngram): the latest,
    or at n = max_ngram the one that agrees furthest back (`_ranked`)."""
    return longest_match(tokens, max_ngram=max_ngram, budget=budget)[0]


def longest_match(tokens: list[int], *, max_ngram: int, budget: int) -> tuple[list[int], int]:
    """`lookup`'s tokens and the match's length (`matched_length`; 0 when nothing matched)."""
    paths, length = continuations(tokens, max_ngram=max_ngram, budget=budget, branches=1)
    return (paths[0] if paths else []), length


def matched_length(tokens: list[int], start: int, n: int) -> int:
    """How many tokens before the end of `tokens` agree with those before `start + n`, where an earlier
    occurrence of the last n tokens starts: n, and as far back past it as they go on agreeing, up to
    `MATCH_CAP`."""
    length, agreed = len(tokens), n
    while agreed < MATCH_CAP and start > agreed - n and tokens[start - 1 - (agreed - n)] == tokens[length - 1 - agreed]:
        agreed += 1
    return agreed


def _ranked(tokens: list[int], starts: Iterable[int], n: int, max_ngram: int) -> tuple[Iterable[int], int]:
    """Earlier occurrences' `starts` (the latest first) in the order they are copied from, and the first's
    match length.

    Below max_ngram every occurrence's length is n (a longer suffix matched
    nowhere, or it would have been looked up instead), so the order stays
    the latest first. At max_ngram the latest `OCCURRENCES_RANKED` go first,
    the one that agrees furthest back first (the latest among equals).
    """
    if n < max_ngram:
        return starts, n  # read lazily: `_follow` stops at its branches
    starts = iter(starts)
    head = sorted(((matched_length(tokens, j, n), j) for j in islice(starts, OCCURRENCES_RANKED)), key=lambda c: -c[0])
    return chain((j for _, j in head), starts), head[0][0]


def agreement(proposal, emitted) -> list[bool]:
    """A proposal's tokens judged against the tokens emitted in their places, as a verify pass judges a draft:
    each that agreed (True), then the first that differed (False), if one did; as far as tokens were emitted."""
    judged = []
    for proposed, token in zip(proposal, emitted):
        judged.append(proposed == token)
        if proposed != token:
            break
    return judged


def continuations(tokens: list[int], *, max_ngram: int, budget: int, branches: int) -> tuple[list[list[int]], int]:
    """Up to `branches` different continuations of the longest matched suffix and the first one's match length.

    The first is `lookup`'s; the others follow other earlier occurrences of
    the same suffix whose continuations differ from those already taken, in
    `_ranked`'s order.
    """
    if budget < 1 or branches < 1:
        return [], 0
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        # earlier occurrences, the latest first: a start j satisfies j + n < length (not the suffix itself)
        starts = [j for j in range(length - n - 1, -1, -1) if tokens[j : j + n] == suffix]
        if starts:
            ordered, matched = _ranked(tokens, starts, n, max_ngram)
            return _follow(tokens, ordered, n, budget, branches), matched
    return [], 0


def _follow(tokens: list[int], starts: Iterable[int], n: int, budget: int, branches: int) -> list[list[int]]:
    """The different continuations after `starts` (in order), up to `branches`."""
    found: list[list[int]] = []
    for j in starts:
        follow = tokens[j + n : j + n + budget]  # never empty: j + n < len(tokens)
        if follow not in found:
            found.append(follow)
            if len(found) == branches:
                break
    return found


class NgramIndex:
    """`longest_match` and `continuations` for a sequence that only grows, without a scan of the sequence.

    For every n <= max_ngram it maps each n-gram to the starts at which it
    occurred, in order, over the n-grams that end before the last token (so
    the suffix itself is never its own match). A query indexes what was
    appended since the last one, then looks the suffixes up, longest first,
    in `_ranked`'s order: the same tokens and match length as the scans. The
    caller keeps one index per sequence (a new sequence, a new index); per
    token it costs O(max_ngram), and a query O(occurrences read), at most
    `OCCURRENCES_RANKED` x `MATCH_CAP` token compares among them.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.starts: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram + 1)]  # by n
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables

    def match(self, tokens: list[int], *, budget: int) -> tuple[list[int], int]:
        """`longest_match(tokens, max_ngram=..., budget=budget)`."""
        paths, n = self.continuations(tokens, budget=budget, branches=1)
        return (paths[0] if paths else []), n

    def continuations(self, tokens: list[int], *, budget: int, branches: int) -> tuple[list[list[int]], int]:
        """`continuations(tokens, max_ngram=..., budget=budget, branches=branches)`."""
        if budget < 1 or branches < 1:
            return [], 0
        length = len(tokens)
        for end in range(self.indexed, length - 1):  # the n-grams ending at `end`, for every n
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.starts[n].setdefault(tuple(tokens[end + 1 - n : end + 1]), []).append(end + 1 - n)
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            starts = self.starts[n].get(tuple(tokens[length - n :]))
            if starts:
                ordered, matched = _ranked(tokens, reversed(starts), n, self.max_ngram)
                return _follow(tokens, ordered, n, budget, branches), matched
        return [], 0
