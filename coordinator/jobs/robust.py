"""Which replicas disagree with the rest: robust scores over what the ranks report.

Pure functions, no I/O. Two kinds of evidence:

- **Numbers** (calibration rates, or vectors such as per-rank loss or gradient-norm
  traces): a Krum-style score (Blanchard et al., 2017). With ``n`` items of which ``f``
  may be faulty, an item's score is the sum of squared distances to its ``k = n − f − 2``
  nearest other items: an item inside the majority has close neighbours and a small
  score; one outside it has none. :func:`outliers` turns scores into a verdict.
- **Fingerprints** (SHA256 of code trees, checkpoints or weights): items are equal or
  not. With that 0/1 distance a Krum score is the number of disagreeing neighbours, which
  reduces exactly to "not holding the majority value": :func:`majority_fingerprint`.

Small ``n``: Krum's guarantee needs ``n ≥ 2f + 3``. The default ``f`` is the largest that
meets it (``(n − 3) // 2``, at least 0), ``k`` is clamped to ``1 … n − 1``, and with fewer
than three items there is no majority to stand outside of, so nothing is an outlier.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

Key = TypeVar("Key", bound=Hashable)
Name = TypeVar("Name", int, str)  # a rank or a node's name: what a fingerprint is held by, sorted
Value = float | Sequence[float]

#: Differences within this fraction of a typical item's magnitude are noise, never outliers
#: (coord splits work equally when rates are within 10% of each other: the same tolerance).
DEFAULT_TOLERANCE = 0.10
#: Scores this many robust standard deviations (1.4826 × MAD) above the median are outliers.
MAD_CUTOFF = 3.0
_MAD_TO_SIGMA = 1.4826
MIN_ITEMS = 3


def default_faulty(n: int) -> int:
    """The largest ``f`` for which Krum's majority argument holds: ``n ≥ 2f + 3``."""
    return max(0, (n - 3) // 2)


def neighbour_count(n: int, f: int) -> int:
    """Krum's ``k = n − f − 2``, clamped to ``1 … n − 1`` so small clusters still score."""
    return max(1, min(n - 1, n - f - 2))


def krum_scores(values: Mapping[Key, Value], f: int | None = None) -> dict[Key, float]:
    """Each item's sum of squared distances to its ``k`` nearest other items.

    ``values`` maps a name (rank, node) to a number or an equal-length vector. Raises
    ValueError for a non-finite value, vectors of different lengths, or ``f < 0``.
    """
    vectors = _as_vectors(values)
    n = len(vectors)
    if n < 2:
        return {key: 0.0 for key in vectors}
    f = default_faulty(n) if f is None else f
    if f < 0:
        raise ValueError(f"f (the number of faulty items) must be ≥ 0, got {f}")
    k = neighbour_count(n, f)
    scores = {}
    for key, vector in vectors.items():
        distances = sorted(_squared_distance(vector, other) for name, other in vectors.items() if name != key)
        scores[key] = sum(distances[:k])
    return scores


def outliers(values: Mapping[Key, Value], f: int | None = None, *,
             tolerance: float = DEFAULT_TOLERANCE) -> list[Key]:
    """The items whose Krum score is far above the others', in the mapping's order.

    The rule: an item is an outlier when its score is both
    (1) more than ``MAD_CUTOFF`` robust standard deviations above the median score
        (1.4826 × the median absolute deviation: far from how the majority scores), and
    (2) more than ``k × (tolerance × m)²``, where ``m`` is the median magnitude of the
        items: its typical distance to its ``k`` neighbours exceeds ``tolerance`` of a
        typical value, so measurement noise is never an outlier.
    Identical items give no outliers; fewer than three items give none (no majority).
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be ≥ 0, got {tolerance}")
    vectors = _as_vectors(values)
    if len(vectors) < MIN_ITEMS:
        return []
    scores = krum_scores(values, f)
    n = len(vectors)
    k = neighbour_count(n, default_faulty(n) if f is None else f)
    median = statistics.median(scores.values())
    spread = _MAD_TO_SIGMA * statistics.median(abs(score - median) for score in scores.values())
    magnitude = statistics.median(math.sqrt(sum(x * x for x in vector)) for vector in vectors.values())
    noise_floor = k * (tolerance * magnitude) ** 2
    cutoff = max(median + MAD_CUTOFF * spread, noise_floor)
    return [key for key, score in scores.items() if score > cutoff]


def majority_fingerprint(fingerprints: Mapping[Name, str | None]) -> tuple[str | None, list[Name]]:
    """(the fingerprint more than half of the items hold, the items that differ from it).

    A missing fingerprint (None) never counts toward a majority and is always divergent.
    With no strict majority (a tie, or everyone different) the answer is ``(None, every
    item)``, as :func:`coordinator.readiness.consistency.compare_nodes` reports "insufficient
    consensus". Divergent items are sorted.
    """
    counts = Counter(value for value in fingerprints.values() if value is not None)
    if not counts:
        return None, sorted(fingerprints)
    value, holders = counts.most_common(1)[0]
    if holders * 2 <= len(fingerprints):
        return None, sorted(fingerprints)
    return value, sorted(key for key, held in fingerprints.items() if held != value)


def _as_vectors(values: Mapping[Key, Value]) -> dict[Key, tuple[float, ...]]:
    vectors: dict[Key, tuple[float, ...]] = {}
    for key, value in values.items():
        vector = (value,) if isinstance(value, (int, float)) else tuple(value)
        if not vector or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                 for x in vector):
            raise ValueError(f"{key}: {value!r} is not a finite number or a non-empty vector of them")
        vectors[key] = tuple(float(x) for x in vector)
    lengths = {len(vector) for vector in vectors.values()}
    if len(lengths) > 1:
        raise ValueError(f"vectors of different lengths: {sorted(lengths)}")
    return vectors


def _squared_distance(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return sum((x - y) ** 2 for x, y in zip(a, b, strict=True))  # _as_vectors made them one length
