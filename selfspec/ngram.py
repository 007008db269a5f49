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
    """`longest_match` for a sequence that only grows, in O(max_ngram) per token instead of a scan.

    For every n <= max_ngram it maps each n-gram to the latest start at which
    it occurred, over the n-grams that end before the last token (so the
    suffix itself is never its own match). `match(tokens)` indexes what was
    appended since the last call, then looks the suffixes up, longest first:
    the same tokens and match length as `longest_match(tokens, ...)`.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # by n
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables

    def match(self, tokens: list[int], *, budget: int) -> tuple[list[int], int]:
        if budget < 1:
            return [], 0
        length = len(tokens)
        for end in range(self.indexed, length - 1):  # the n-grams ending at `end`, for every n
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.latest[n][tuple(tokens[end + 1 - n : end + 1])] = end + 1 - n
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = self.latest[n].get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + budget], n
        return [], 0
