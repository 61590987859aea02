"""BlackJack's cards: an infinite deck dealt from each game's seed, a whole batch of games at once.

gymnasium's Blackjack-v1 draws every card with a NumPy ``choice`` on a generator it makes for each
game: three quarters of a rollout's env time went there. Here card ``k`` of the game with seed
``s`` is a pure function of ``(s, k)`` (SplitMix64, a counter-based generator), so dealing a
batch is a few vectorised NumPy operations, a replayed game gets the same cards, and a game that
needs more cards than were dealt draws them from the same stream. The deck is gymnasium's: each
of 13 ranks equally likely, face cards worth 10, an ace 1 (or 11 while that does not bust).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

RANKS = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10, 10], dtype=np.int64)
"""The value of each of the 13 equally likely ranks (ace = 1)."""
CARDS_DEALT = 12
"""Cards dealt with a game: its hands and the draws of almost every game (a game drawing more gets
the next ones from the same stream)."""

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every bit of the output depends on every bit of ``z``."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def deal(seeds: Sequence[int], first: int = 0, count: int = CARDS_DEALT) -> np.ndarray:
    """Cards ``first .. first + count`` of each game (its seed), as values 1..10: an int array of
    shape ``(len(seeds), count)``. The same (seed, index) always gives the same card."""
    streams = _mix(np.array([s % 2**64 for s in seeds], dtype=np.uint64))
    index = np.arange(first + 1, first + count + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as SplitMix64 means it to
        bits = _mix(streams[:, None] + index[None, :] * _GAMMA)
    # The top 32 bits scaled to 13 ranks (multiply-shift: a bias below 13 / 2**32).
    return RANKS[((bits >> np.uint64(32)) * np.uint64(13)) >> np.uint64(32)]
