"""A solution of kvlab.puzzles.ngram_proposer."""


def propose(tokens: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # Earlier occurrences end before the last token; the most recent one is searched first.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + max_tokens]
    return []
