"""Random walks through a grammar's masks (runtime.speculation.grammar.window.GrammarWindow), for
tests that check every output a grammar allows parses and validates."""

from __future__ import annotations

import random
from collections.abc import Collection

from runtime.speculation.grammar.window import GrammarWindow


def walk(
    window: GrammarWindow,
    rng: random.Random,
    stops: set[int],
    end_p: float = 0.5,
    closers: Collection[int] = (),
    close_p: float = 0.0,
    limit: int = 300,
) -> list[int]:
    """Tokens drawn from each position's mask until a stop token is taken: a stop token with
    probability end_p once the grammar is complete, else one of `closers` (a quote, a brace)
    with probability close_p where allowed, else any allowed token. Checks on the way that
    the stop tokens are allowed exactly when the grammar is complete, and that advancing,
    rolling back and committing a token agree."""
    out: list[int] = []
    while not window.is_terminated:
        allowed = window.next_mask().nonzero().flatten().tolist()
        ending = [t for t in allowed if t in stops]
        assert ending == sorted(stops) if window.is_complete else not ending
        going = [t for t in allowed if t not in stops]
        assert going or ending, "a dead end"
        closing = [t for t in going if t in closers]
        if ending and (rng.random() < end_p or not going):
            token = rng.choice(ending)
        else:
            token = rng.choice(closing if closing and rng.random() < close_p else going)
        assert window.advance(token)
        window.rollback(1)
        window.commit([token])
        out.append(token)
        assert len(out) < limit, "no end in sight"
    return out
