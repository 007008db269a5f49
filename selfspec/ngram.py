"""N-gram proposals (prompt lookup): draft by copying what followed an earlier match.

When the last n tokens of the sequence occurred before (in the prompt or the
output so far), the tokens that followed that occurrence are a free guess of
what comes next. Summaries, RAG answers and code edits repeat their context
often, so the guess is often right, and it costs no model computation.

This module only searches token lists; it knows nothing of models or caches.
"""

from __future__ import annotations


def lookup(tokens: list[int], *, max_ngram: int, budget: int) -> list[int]:
    """Up to `budget` tokens that followed the latest earlier match of the longest suffix (n <= max_ngram)."""
    return longest_match(tokens, max_ngram=max_ngram, budget=budget)[0]


def longest_match(tokens: list[int], *, max_ngram: int, budget: int) -> tuple[list[int], int]:
    """`lookup`'s tokens and the length n of the matched suffix (0 when nothing matched)."""
    if budget < 1:
        return [], 0
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        # latest earlier occurrence: its start j satisfies j + n < length (not the suffix itself)
        for j in range(length - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + budget], n
    return [], 0


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
    """Up to `branches` different continuations of the longest matched suffix (latest match first) and its length.

    The first is `lookup`'s; the others follow earlier occurrences of the
    same suffix whose continuations differ from those already taken.
    """
    if budget < 1 or branches < 1:
        return [], 0
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        found: list[list[int]] = []
        for j in range(length - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                follow = tokens[j + n : j + n + budget]
                if follow and follow not in found:
                    found.append(follow)
                    if len(found) == branches:
                        break
        if found:
            return found, n
    return [], 0


class NgramIndex:
    """`longest_match` and `continuations` for a sequence that only grows, without a scan of the sequence.

    For every n <= max_ngram it maps each n-gram to the starts at which it
    occurred, in order, over the n-grams that end before the last token (so
    the suffix itself is never its own match). A query indexes what was
    appended since the last one, then looks the suffixes up, longest first,
    the latest occurrence first: the same tokens and match length as the
    scans. The caller keeps one index per sequence (a new sequence, a new
    index); per token it costs O(max_ngram), and a query O(occurrences read).
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
            if not starts:
                continue
            found: list[list[int]] = []
            for j in reversed(starts):
                follow = tokens[j + n : j + n + budget]
                if follow not in found:
                    found.append(follow)
                    if len(found) == branches:
                        break
            return found, n
        return [], 0
