"""The inputs of the edge tests (``conformance/tests/test_edges.py``, SPEC §2.5, §3.8,
§4.7-§4.9, §12.12): garbage values, the slots no query attends, the problems that leave
slots unused, the NaN placed where a test wants it.

Which keys a row attends comes from ``fixtures/oracle.py:allowed_keys`` (and the float
mask's -inf entries), never from the backend under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.fixtures.oracle import allowed_keys
from conformance.suite.domain import OUTSIDE, domain_of, head_dims_inside, inside
from conformance.suite.domain_summary import MOVED_PROPERTY
from conformance.suite.helpers import as64, random_qkv
from conformance.suite.requirements import value_dims
from conformance.vocabulary import numpy_dtype


def finfo_max(dtype: str) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(numpy_dtype(dtype)).max)


def garbage_values(kind: str, n: int, dtype: str) -> np.ndarray:
    """n values of one kind of garbage: "nan", "inf" (±inf), "max" (± the dtype's largest
    finite number) or "mixed" (all of them in turn)."""
    big = finfo_max(dtype)
    cycle = {
        "nan": [np.nan],
        "inf": [np.inf, -np.inf],
        "max": [big, -big],
        "mixed": [np.nan, np.inf, -np.inf, big, -big],
    }[kind]
    return np.array([cycle[i % len(cycle)] for i in range(n)], dtype=np.float64)


def fill(x: np.ndarray, slots: np.ndarray, values: np.ndarray) -> np.ndarray:
    """x (B, K, S, ·) with every entry of the slots[b, κ, s] rows set from ``values``."""
    x = x.copy()
    rows = np.broadcast_to(slots[..., None], x.shape)
    x[rows] = values[: int(rows.sum())].astype(x.dtype)
    return x


def attended(q, k, mask, options) -> np.ndarray:
    """(B, H, T, S) bool: which keys each query row attends (SPEC §1.2), from the oracle's
    ``allowed_keys`` and the float mask's -inf entries."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    full = None if mask is None else np.broadcast_to(mask, (B, H, T, S))
    out = np.zeros((B, H, T, S), dtype=bool)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                bool_row = full[b, h, t] if full is not None and full.dtype == np.bool_ else None
                keys = allowed_keys(
                    t,
                    T,
                    S,
                    bool_row=bool_row,
                    is_causal=options.get("is_causal", False),
                    causal_alignment=options.get("causal_alignment", "top_left"),
                    window=options.get("window"),
                )
                out[b, h, t, keys] = True
    if full is not None and full.dtype != np.bool_:
        out &= as64(full) != -np.inf
    return out


def unused_slots(q, k, mask, options) -> np.ndarray:
    """(B, K, S) bool: slots that no query row of their batch element and key/value head
    attends (SPEC §4.7)."""
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    K = k.shape[1]
    seen = attended(q, k, mask, options).reshape(B, K, H // K, T, S)
    return ~seen.any(axis=(2, 3))


def empty_options(how: str, T: int, S: int, dtype: str) -> dict:
    if how == "causal":
        return {"is_causal": True}
    if how == "bool-mask":
        return {"mask": np.ones((T, S), dtype=bool)}
    if how == "float-mask":
        return {"mask": np.zeros((1, 1, T, S), dtype=numpy_dtype(dtype))}
    if how == "softcap":
        return {"softcap": 2.0}
    return {}


def inert_sizes(backend, method: str = "attention", node=None) -> tuple[int, int, int, int]:
    """(T, S, D, E) of the unused-slot problems: 5 queries against 9 keys, or, for a kernel
    that declares a domain, the least lengths and head dims inside it with T < S still
    (a top-left causal call leaves keys unused only there). The problems are built at
    those sizes, so every slot the test calls unused is one the kernel's own call leaves
    unused; padding the call into the domain instead would add queries that attend them.

    Raises:
      pytest.skip.Exception: the domain has no T < S (T = S only) or no head dim for D.
    """
    D, E = value_dims(backend, 4, 3)
    domain = domain_of(backend).of(method)
    if domain.everything:
        return 5, 9, D, E
    T, S = inside(domain, 5, 9)
    D2, E2 = head_dims_inside(backend, domain, D, E)
    if T >= S or D2 is None:
        why = "no T < S" if T >= S else f"no head dim of at least {max(D, E)}"
        pytest.skip(f"{OUTSIDE} {backend.name} ({domain.words()}): {why} to build it at")
    if node is not None and (T, S, D2, E2) != (5, 9, D, E):
        text = f"T5-S9-D{D}-E{E} -> T{T}-S{S}-D{D2}-E{E2} (unused slots)"
        node.user_properties.append((MOVED_PROPERTY, json.dumps([backend.name, text])))
    return T, S, D2, E2


def inert_problem(backend, how: str, dtype: str, seed: int = 80, *, method="attention", node=None):
    """Inputs, options and the (B, K, S) unused slots for one way of leaving slots unused,
    at ``inert_sizes``."""
    B, H, K = 2, 4, 4
    if how == "gqa-group":
        K = 2
    T, S, D, E = inert_sizes(backend, method, node)
    q, k, v = random_qkv(seed, B=B, H=H, K=K, T=T, S=S, D=D, E=E, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    options: dict = {}
    if how == "padding":
        lengths = np.array([6, 3])
        options["mask"] = (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    elif how == "bool-column":
        mask = rng.random((B, H, T, S)) < 0.8
        mask[..., [0, 4, 8]] = False
        options["mask"] = mask
    elif how == "float-column":
        mask = rng.standard_normal((T, S))
        mask[rng.random((T, S)) < 0.2] = -np.inf
        mask[:, [2, 7]] = -np.inf
        options["mask"] = mask.astype(numpy_dtype(dtype))
    elif how == "causal-T<S":
        options["is_causal"] = True
    elif how == "window":
        options.update(window=(1, 0), causal_alignment="bottom_right")
    else:
        mask = rng.random((1, H, T, S)) < 0.8
        mask[:, 0:2, :, 3] = False  # key 3 unused in group 0 (heads 0, 1), used in group 1
        mask[:, 2:4, :, 6] = False  # key 6 the other way round
        options["mask"] = mask
    unused = unused_slots(q, k, options.get("mask"), options)
    assert unused.any() and not unused.all()
    return q, k, v, options, unused


def with_garbage(k, v, unused, garbage: str, dtype: str):
    n = 10 * k.size
    return (
        fill(k, unused, garbage_values(garbage, n, dtype)),
        fill(v, unused, garbage_values(garbage, n, dtype)[::-1].copy()),
    )


def shared_key_options(how: str, T: int, S: int, dtype) -> dict:
    """§4.8's options: key 3 attended by some rows and blocked for others (``how``:
    causal, window, bool-mask or float-mask)."""
    options: dict = {}
    if how == "causal":
        options["is_causal"] = True
    elif how == "window":
        options["window"] = (1, 1)
    else:
        mask = np.random.default_rng(91).random((T, S)) < 0.8
        mask[:, 3] = [True, False, True, False, False, True]
        options["mask"] = mask if how == "bool-mask" else np.where(mask, 0.5, -np.inf)
        if how == "float-mask":
            options["mask"] = options["mask"].astype(dtype)
    return options


def with_nan(q, k, v, at: str):
    """Copies of q, k, v with a NaN ``at`` one place of batch element 1 (§4.9), and the
    (B, H) bool of the (batch, head) pairs that read it."""
    B, H, K = q.shape[0], q.shape[1], k.shape[1]
    G = H // K
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    b, kv = 1, K - 1
    reading = np.zeros((B, H), dtype=bool)  # the (batch, head) pairs that read the NaN
    if at == "q":
        q2[b, H - 1, 0, 1] = np.nan  # row 0: under causal it attends key 0 alone
        reading[b, H - 1] = True
    else:
        if at == "k-first":
            k2[b, kv, 0, 2] = np.nan
        elif at == "k-middle":
            k2[b, kv, 3, 0] = np.nan
        elif at == "k-all":
            k2[b, kv, :, 1] = np.nan
        else:
            v2[b, kv, 0, 1] = np.nan
        reading[b, kv * G : (kv + 1) * G] = True
    return q2, k2, v2, reading


# --- Rows that reach the key tiles of blockwise kernels (issue 31) --------------------------

#: Key tiles real kernels use are 64 to 256 keys: rows of 300 keys put tile boundaries at
#: 128 and 256 inside the masked regions below.
TILE_S = 300
#: How a row's first or last key tiles end up fully masked: (options, capabilities, the
#: batch and query counts). Few queries where few do, since the 50-digit oracle costs
#: about 80 µs a key a row.
TILE_SETUPS = {
    # Row t attends keys up to t + 252: for rows 0-3 the tile from 256 on is fully masked.
    "bottom-right-T<S": (
        {"is_causal": True, "causal_alignment": "bottom_right"},
        ["causal_bottom_right"],
        (1, 48),
    ),
    # Batch element 1 is 100 keys long: its tiles from 128 on are all padding.
    "padding": ({"mask": "right-padding"}, [], (2, 8)),
    # Batch element 1 is padded on the left, as a batch of prompts for generation is: its
    # first 200 keys, the first tile and half the second, are blocked.
    "left-padding": ({"mask": "left-padding"}, [], (2, 8)),
    # The 41 keys up to each row's bottom-right diagonal: every row's first tiles blocked.
    "window": (
        {"window": (40, 0), "causal_alignment": "bottom_right"},
        ["window", "causal_bottom_right"],
        (2, 8),
    ),
    # Holes across the tile boundaries 128 and 256, in ordinary rows.
    "holes": ({"mask": "holes"}, [], (2, 8)),
}
#: The scores' offset: ordinary scores, and rows whose scores are all far below 0.
TILE_OFFSETS = {"scores-0": 0.0, "scores-100": -100.0, "scores-1e4": -1e4}


def tile_problem(setup: str, offset: float, dtype: str, E: int = 4):
    """q, k, v and options of a tile-boundary case: H = K = 1, D = 4, S = 300 keys, B and T
    as ``TILE_SETUPS`` gives them, scores ``offset`` + about N(0, 0.75) at the default
    scale 1/√D = 1/2 (q's first channel 1, k's 2 · offset, the rest normal)."""
    options, _, (B, T) = TILE_SETUPS[setup]
    options = dict(options)
    H, D, S = 1, 4, TILE_S
    rng = np.random.default_rng(120)
    q = rng.standard_normal((B, H, T, D))  # (B, H, T, D)
    k = rng.standard_normal((B, H, S, D))  # (B, K, S, D)
    v = rng.standard_normal((B, H, S, E))  # (B, K, S, E)
    q[..., 0] = 1.0
    k[..., 0] = 2.0 * offset
    keys = np.arange(S)
    if options.get("mask") == "right-padding":
        options["mask"] = (keys < np.array([[S], [100]]))[:, None, None, :]  # (B, 1, 1, S)
    elif options.get("mask") == "left-padding":
        options["mask"] = (keys >= np.array([[0], [200]]))[:, None, None, :]  # (B, 1, 1, S)
    elif options.get("mask") == "holes":
        holes = ((keys >= 120) & (keys < 140)) | ((keys >= 250) & (keys < 262))
        options["mask"] = np.broadcast_to(~holes, (T, S)).copy()  # (T, S)
    t = numpy_dtype(dtype)
    return q.astype(t), k.astype(t), v.astype(t), options
