"""Do the nodes hold the same code, script, data and model? Pure policy over manifests.

The majority tree is the reference; the agreement ratio is the share of nodes
holding it. Each divergent node is named with the files that differ and how.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal, NotRequired, TypedDict

from shared.manifest import tree_hash

DEFAULT_THRESHOLD = 0.95
MAX_LISTED = 20

Manifest = dict[str, list[Any]]  # rel -> [size, mode, sha256], as the agents send it


class Difference(TypedDict):
    """One file that differs from the reference tree, and how."""

    path: str
    how: Literal["missing", "extra", "other hash", "other mode"]
    expected: NotRequired[str]  # the reference's hash or mode (other hash, other mode)
    found: NotRequired[str]


class DivergentNode(TypedDict):
    node: str
    hash: str
    differences: list[Difference]  # the first MAX_LISTED
    difference_count: int


class ConsistencyReport(TypedDict):
    """``compare_nodes``: one tree (or file set) across nodes."""

    what: str
    nodes: int
    threshold: float
    hashes: dict[str, str]  # node -> its tree hash
    divergent: list[DivergentNode]
    ratio: float
    majority_hash: NotRequired[str | None]  # absent when no node reported; None without a majority
    status: Literal["pass", "fail"]
    detail: str


def diff_manifests(reference: Manifest, other: Manifest) -> list[Difference]:
    """How ``other`` differs from ``reference``: missing, extra, other hash, other mode."""
    out: list[Difference] = []
    for rel in sorted(set(reference) | set(other)):
        want, have = reference.get(rel), other.get(rel)
        if have is None:
            out.append({"path": rel, "how": "missing"})
        elif want is None:
            out.append({"path": rel, "how": "extra"})
        elif want[2] != have[2]:
            out.append({"path": rel, "how": "other hash", "expected": want[2][:12], "found": have[2][:12]})
        elif want[1] != have[1]:
            out.append({"path": rel, "how": "other mode", "expected": f"{want[1] & 0o7777:o}",
                        "found": f"{have[1] & 0o7777:o}"})  # permissions: a directory's type bits are no news
    return out


def compare_nodes(manifests: dict[str, Manifest], *, threshold: float = DEFAULT_THRESHOLD,
                  what: str = "code") -> ConsistencyReport:
    """Compare one tree (or file set) across nodes; status pass or fail, with the evidence."""
    hashes = {node: tree_hash(manifest) for node, manifest in manifests.items()}
    total = len(hashes)
    if total == 0:
        return {"what": what, "nodes": total, "threshold": threshold, "hashes": hashes, "divergent": [],
                "status": "fail", "ratio": 0.0, "detail": f"no node reported its {what}"}
    if total == 1:
        return {"what": what, "nodes": total, "threshold": threshold, "hashes": hashes, "divergent": [],
                "status": "pass", "ratio": 1.0, "majority_hash": next(iter(hashes.values())),
                "detail": f"one node: nothing to compare its {what} with"}
    counts = Counter(hashes.values())
    majority_hash, agreeing = counts.most_common(1)[0]
    tie = sum(1 for count in counts.values() if count == agreeing) > 1
    ratio = agreeing / total
    if tie or agreeing * 2 <= total:
        return {"what": what, "nodes": total, "threshold": threshold, "hashes": hashes,
                "divergent": _divergent(manifests, hashes, None, majority_hash), "ratio": round(ratio, 4),
                "status": "fail", "majority_hash": None,
                "detail": f"insufficient consensus on the {what}: no tree is held by a majority of nodes "
                          f"({', '.join(f'{h[:12]}×{c}' for h, c in counts.most_common())})"}
    reference = next(manifests[n] for n, h in hashes.items() if h == majority_hash)
    divergent = _divergent(manifests, hashes, reference, majority_hash)
    if not divergent:
        detail = f"all {total} nodes hold the same {what} ({majority_hash[:12]})"
    else:
        parts = []
        for entry in divergent:
            files = ", ".join(f"{d['path']} ({d['how']})" for d in entry["differences"][:5])
            more = entry["difference_count"] - min(5, entry["difference_count"])
            parts.append(f"{entry['node']}: {files}" + (f" and {more} more" if more else ""))
        detail = (f"{agreeing}/{total} nodes agree on the {what} (ratio {ratio:.2f}, threshold "
                  f"{threshold:.2f}); divergent: " + "; ".join(parts))
    return {"what": what, "nodes": total, "threshold": threshold, "hashes": hashes, "divergent": divergent,
            "ratio": round(ratio, 4), "majority_hash": majority_hash,
            "status": "pass" if ratio >= threshold else "fail", "detail": detail}


def _divergent(manifests: dict[str, Manifest], hashes: dict[str, str], reference: Manifest | None,
               majority_hash: str) -> list[DivergentNode]:
    """The nodes off the reference tree, with their differences; every node when there is none."""
    out: list[DivergentNode] = []
    for node, digest in sorted(hashes.items()):
        if reference is not None and digest == majority_hash:
            continue
        differences = diff_manifests(reference, manifests[node]) if reference is not None else []
        out.append({"node": node, "hash": digest, "differences": differences[:MAX_LISTED],
                    "difference_count": len(differences)})
    return out
