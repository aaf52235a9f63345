"""The split-KV pages (SPEC §22.8): what the conformance run cannot show at its sizes.

The conformance suite runs numpy-split and torch-split with three chunks on its short
rows. These tests cover the rest: the default chunking on a long decode row, against the
core page; that no array spans two chunks (the largest intermediate is set by the chunk,
not by S); the chunks themselves; and the JAX page, which has no backend, against the
oracle on the shapes test_merge.py already compiles, and on the long row.
"""

from __future__ import annotations

import tracemalloc

import jax
import numpy as np
import pytest
import torch
from conformance.fixtures import oracle
from conformance.impls.jax import split_kv as jax_split
from conformance.impls.numpy import attention as numpy_attention
from conformance.impls.numpy import split_kv as numpy_split
from conformance.impls.torch import split_kv as torch_split
from torch.utils._python_dispatch import TorchDispatchMode

from conformance import load_backend
from conformance.suite.helpers import random_qkv, random_tolerance
from conformance.suite.tolerance import assert_within, tolerance

pytestmark = pytest.mark.clause("22.8")

PAGES = {
    "numpy": numpy_split.attention,
    "torch": lambda *a, **o: torch_split.attention(
        *(torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in a),
        **{n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in o.items()},
    ),
    # device_put moves the bytes as they are; jnp.asarray would compile a copy per shape.
    "jax": lambda *a, **o: jax_split.attention(
        *(jax.device_put(x) if isinstance(x, np.ndarray) else x for x in a),
        **{n: jax.device_put(x) if isinstance(x, np.ndarray) else x for n, x in o.items()},
    ),
}
#: A long decode row's options: plain, and everything a serving engine's decode meets.
LONG = {
    "plain": {},
    "gqa-bottom-right-window-sinks-alibi": {
        "is_causal": True,
        "causal_alignment": "bottom_right",
        "window": (2500, None),
        "sinks": np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32),
        "alibi_slopes": np.array([0.5, 0.0625, 0.25, 0.0078125], dtype=np.float32),
    },
}


@pytest.mark.parametrize("page", list(PAGES))
@pytest.mark.parametrize("setup", list(LONG))
def test_default_chunks_on_a_long_decode_row(page, setup):
    """T = 4 queries against S = 3000 keys: three default chunks (1000 keys each), the
    output within the tolerance of the core page's."""
    jax.config.update("jax_enable_x64", True)
    q, k, v = random_qkv(90, B=1, H=4, K=2, T=4, S=3000, D=16, E=8, dtype="float32")
    options = LONG[setup]
    out = np.asarray(PAGES[page](q, k, v, **options))
    ref = numpy_attention.attention(q, k, v, **options)
    tol = 2 * random_tolerance(q, k, v, "float32", **options)
    assert_within(out, ref, tol, f"{page} split_kv with default chunks ({setup})")


def test_the_chunks():
    """num_splits chunks of lengths that differ by at most one; left out, chunks of at
    most 1024 keys; an S shorter than the count leaves some chunks empty."""
    assert numpy_split.chunks(5, 3) == [(0, 1), (1, 3), (3, 5)]
    assert numpy_split.chunks(2, 3) == [(0, 0), (0, 1), (1, 2)]
    assert numpy_split.chunks(0, None) == [(0, 0)]
    for S in (1, 1024, 1025, 5000):
        found = numpy_split.chunks(S, None)
        assert len(found) == -(-S // 1024)
        assert max(s1 - s0 for s0, s1 in found) <= 1024
    assert torch_split.chunks(5000, None) == jax_split.chunks(5000, None) == found


def test_the_backends_default_to_the_fast_chunking():
    """Users get the default chunking; the conformance run passes three chunks."""
    for name in ("numpy-split", "torch-split"):
        backend = load_backend(name)
        assert backend.num_splits is None and backend.options == {}
        assert dict(backend.conformance_options) == {"num_splits": 3}
        assert load_backend(name, num_splits=5).num_splits == 5


def _numpy_peak(S: int, num_splits: int) -> tuple[int, int]:
    """Peak bytes allocated during a decode call, and one (B, H, T, S) float32 matrix."""
    B, H, T = 1, 8, 4
    q, k, v = random_qkv(91, B=B, H=H, K=1, T=T, S=S, D=16, dtype="float32")
    tracemalloc.start()
    try:
        numpy_split.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              num_splits=num_splits)  # fmt: skip
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, B * H * T * S * 4


def test_numpy_split_never_builds_the_score_matrix():
    """The peak allocation is set by the chunk, not by S: chunks of 512 keys peak alike
    for S = 16384 and S = 32768, and below half of one (B, H, T, S) score matrix."""
    small, _ = _numpy_peak(16384, 32)
    large, matrix = _numpy_peak(32768, 64)
    assert large < matrix / 2, f"peak {large} bytes vs one score matrix {matrix}"
    assert large < 1.25 * small, f"peak grows with S at a fixed chunk: {small} -> {large}"


class _LargestOutput(TorchDispatchMode):
    """The largest tensor (in elements) any operation returns inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_torch_split_never_builds_the_score_matrix():
    """No operation of the torch page returns more elements than a chunk's scores or its
    repeated keys, (B, H, max(T, D, E), S / num_splits): far from B·H·T·S."""
    B, H, T, S, D, n = 1, 8, 4, 16384, 16, 32
    q, k, v = (torch.from_numpy(x) for x in random_qkv(92, B=B, H=H, K=1, T=T, S=S, D=D))
    with _LargestOutput() as seen:
        torch_split.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              num_splits=n)  # fmt: skip
    chunk = B * H * max(T, D) * (S // n)
    assert seen.largest <= chunk, f"an operation returned {seen.largest} elements"
    assert seen.largest < B * H * T * S / 4


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_jax_page_against_the_oracle(dtype):
    """The JAX page on test_merge.py's shapes (B=2, H=3, T=7, S=13, D=E=5), three chunks,
    sinks and a bool mask with a row of no key: out and lse within §7's rule (the naive
    run's error, and the naive log-sum-exp's)."""
    from conformance.fixtures.oracle import naive_lse_same_precision, naive_same_precision

    from conformance.backends import numpy_dtype
    from conformance.suite.tolerance import finite_error

    jax.config.update("jax_enable_x64", True)
    q, k, v = random_qkv(93, B=2, H=3, T=7, S=13, D=5, dtype=dtype)
    mask = np.random.default_rng(94).random((2, 3, 7, 13)) < 0.6
    mask[1, 2, 3] = False
    sinks = np.array([0.5, -1.0, 2.0]).astype(numpy_dtype(dtype))
    options = {"mask": mask, "sinks": sinks, "is_causal": True}
    out, lse = PAGES["jax"](q, k, v, num_splits=3, return_lse=True, **options)
    wide = {**options, "sinks": sinks.astype(np.float64)}
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    expected, expected_lse = oracle.attention(q64, k64, v64, return_lse=True, **wide)
    naive = naive_same_precision(q64, k64, v64, numpy_dtype(dtype), **wide)
    naive_lse = naive_lse_same_precision(q64, k64, v64, numpy_dtype(dtype), **wide)
    assert np.asarray(lse).dtype == numpy_dtype(dtype)
    assert_within(out, expected, tolerance(dtype, finite_error(naive, expected), expected), "out")
    lse_tol = tolerance(dtype, finite_error(naive_lse, expected_lse), expected_lse)
    assert_within(lse, expected_lse, lse_tol, "lse")


def test_the_merge_pages_open_with_the_formula_they_run():
    """``textbook_merge``, the formula on each merge page's first screen, is what
    ``merge_states`` returns on pieces that each saw a key (NumPy and PyTorch; the JAX
    page's is the same lines)."""
    from conformance.impls.numpy import merge as numpy_merge
    from conformance.impls.torch import merge as torch_merge

    rng = np.random.default_rng(100)
    o_a, o_b = rng.standard_normal((2, 2, 3, 7, 5))  # (B, H, T, E) each
    lse_a, lse_b = rng.uniform(-30, 30, (2, 2, 3, 7))  # (B, H, T) each
    for page, conv in ((numpy_merge, np.asarray), (torch_merge, torch.from_numpy)):
        args = [conv(x) for x in (o_a, lse_a, o_b, lse_b)]
        for got, want in zip(page.merge_states(*args), page.textbook_merge(*args)):
            assert_within(np.asarray(got), np.asarray(want), 1e-14, page.__name__)


def test_the_merge_pages_share_their_helpers():
    """The three merge pages define the same steps under the same names (``merge_partials``
    the (o, m, l) merge that ``merge_states`` runs), as the core pages share theirs."""
    from conformance.impls.jax import merge as jax_merge
    from conformance.impls.numpy import merge as numpy_merge
    from conformance.impls.torch import merge as torch_merge

    def helpers(page):
        return {n for n, f in vars(page).items() if callable(f) and f.__module__ == page.__name__}

    names = helpers(numpy_merge)
    assert {"textbook_merge", "merge_states", "merge_partials", "union_lse"} <= names
    assert helpers(torch_merge) == names
    assert helpers(jax_merge) == names | {"merged"}  # merge_states's steps under jax.jit


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_merge_partials_of_block_states_is_the_union(framework):
    """Three key blocks' states (o, m, l), m a block's largest score and l = exp(lse − m),
    from the oracle at 50 digits; merged left to right by ``merge_partials`` in float64,
    the union is the oracle's attention over all keys (o, and lse = m + log l). Causal, so
    that early rows see no key of the late blocks (the empty state, m = −inf, l = 0)."""
    from conformance.impls.numpy import merge as numpy_merge
    from conformance.impls.torch import merge as torch_merge

    page, conv = {
        "numpy": (numpy_merge, np.asarray),
        "torch": (torch_merge, torch.from_numpy),
    }[framework]
    q, k, v = random_qkv(101, B=2, H=3, T=13, S=13, D=5)
    scores = np.einsum("bhtd,bhsd->bhts", q, np.repeat(k, 3 // k.shape[1], axis=1)) / np.sqrt(5)
    causal = np.tril(np.ones((13, 13), dtype=bool))  # (T, S)
    state = None
    for cols in (slice(0, 4), slice(4, 9), slice(9, 13)):
        mask = causal[:, cols]  # (T, Sb)
        o_b, lse_b = oracle.attention(q, k[:, :, cols], v[:, :, cols], mask=mask, return_lse=True)
        m_b = np.where(mask, scores[..., cols], -np.inf).max(axis=-1)  # (B, H, T)
        with np.errstate(invalid="ignore"):
            l_b = np.where(np.isfinite(lse_b), np.exp(lse_b - m_b), 0.0)  # (B, H, T)
        piece = [conv(np.ascontiguousarray(x)) for x in (o_b, m_b, l_b)]
        state = piece if state is None else page.merge_partials(*state, *piece)
    o, m, l = (np.asarray(x) for x in state)
    lse = np.asarray(page.union_lse(*(conv(x) for x in (m, l))))
    expected, expected_lse = oracle.attention(q, k, v, is_causal=True, return_lse=True)
    assert_within(o, expected, tolerance("float64", 0.0, expected), f"{framework} o")
    assert_within(lse, expected_lse, tolerance("float64", 0.0, expected_lse), f"{framework} lse")
