"""The online softmax walkthrough's numbers (docs/walkthrough/flash.md), for
``python -m conformance walkthrough``: the worked example's scores, each row's running
maximum m, rescale α, sum l and accumulator a after each key tile, and the output beside
the plain softmax's. As in ``walkthrough.py``, whose tables it writes them in, nothing is
written where the arithmetic by hand differs from ``impls/numpy/flash.py`` or from the hand
values of ``fixtures/worked_example.json``.
"""

from __future__ import annotations

import math

import numpy as np

from conformance.impls.numpy import flash as numpy_flash
from conformance.suite.cases import worked_example
from conformance.walkthrough import CASES, _agree, _check, _qkv, _table

#: The online softmax page's two key tiles: key 0, then keys 1-2, so that row 1's
#: maximum moves in the second (its largest score is key 1's).
KEY_TILES = ((0, 1), (1, 3))


def flash_steps(q: np.ndarray, k: np.ndarray, v: np.ndarray, is_causal: bool) -> dict:
    """The online softmax of the example over its two key tiles (``KEY_TILES``), by hand:
    each row's m, α, l and a after each tile, and a / l, which must be the plain softmax's
    output, ``flash.py``'s textbook and fast paths' (on tiles of 1 and of 2 keys) and its
    one-row recurrence's (``online_softmax_row``)."""
    T, D = q.shape
    S = k.shape[0]
    allowed = np.tril(np.ones((T, S), dtype=bool)) if is_causal else np.ones((T, S), bool)
    x = np.where(allowed, q @ k.T / math.sqrt(D), -np.inf)  # (T, S)
    m, l, a = np.full(T, -np.inf), np.zeros(T), np.zeros((T, v.shape[1]))  # (T,), (T,), (T, E)
    after = []
    for s0, s1 in KEY_TILES:
        m_new = np.maximum(m, x[:, s0:s1].max(axis=1))  # (T,)
        alpha = np.exp(m - m_new)  # (T,)
        p = np.exp(x[:, s0:s1] - m_new[:, None])  # (T, Sb)
        l = alpha * l + p.sum(axis=1)  # (T,)
        a = alpha[:, None] * a + p @ v[s0:s1]  # (T, E)
        m = m_new
        after.append(np.column_stack([m, alpha, l, a]))  # (T, 3 + E)
    out = a / l[:, None]  # (T, E)
    plain = np.exp(x - x.max(axis=1, keepdims=True))  # (T, S)
    plain = plain / plain.sum(axis=1, keepdims=True) @ v  # (T, E)
    _agree("online softmax walkthrough output", out, plain, "the plain softmax")
    args = (q[None, None], k[None, None], v[None, None])
    for Sb, fast in ((1, False), (2, False), (1, True), (2, True)):
        impl = numpy_flash.attention(*args, is_causal=is_causal, block_k=Sb, fast=fast)
        _agree("online softmax walkthrough output", out, impl[0, 0], "impls/numpy/flash.py")
        rows = [numpy_flash.online_softmax_row(x[t], v, Sb) for t in range(T)]
        _agree("online softmax walkthrough output", out, np.array(rows), "online_softmax_row")
    return {"scores": x, "tiles": after, "out": np.column_stack([out, plain])}


def flash_numbers() -> dict[str, str]:
    """The online softmax page's sections: each case's scores, the running quantities after
    each key tile, and the output beside the plain softmax's."""
    ex = worked_example()
    q, k, v = _qkv(ex)
    E = v.shape[1]
    running = ["m", "α", "l"] + [f"a[{e}]" for e in range(E)]
    named = {}
    for case, is_causal in CASES.items():
        n = flash_steps(q, k, v, is_causal)
        _check(f"the {case} output", n["out"][:, :E], ex[case.replace("-", "_")]["exact"], "flash")
        named[f"{case}-scores"] = _table(n["scores"], "t \\ s")
        for j, after in enumerate(n["tiles"]):
            named[f"{case}-tile-{j}"] = _table(after, "t", labels=running)
        labels = [f"a[{e}] / l" for e in range(E)] + [f"plain[{e}]" for e in range(E)]
        named[f"{case}-out"] = _table(n["out"], "t", labels=labels)
    return named
