"""The checks of the two layouts beyond one call: packed documents (SPEC §18) and paged KV
caches (§19)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .core import Checked, check, check_d_out
from .numbers import check_bool, check_softcap, check_window, dtype_name, is_floating, positive


def check_packed(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    **options: Any,
) -> tuple[Checked, list[int], list[int]]:
    """Check one packed call (SPEC §18): q (H, T, D), k (K, S, D), v (K, S, E) in the
    unbatched layout, the documents' cumulative lengths, and the options of ``check``
    (no mask, no dropout: the documents are the mask). Returns the checked call and the
    two boundary lists as Python ints, [0, ..., T] and [0, ..., S], both N + 1 long."""
    for name, x, letters in (("q", q, "(H, T, D)"), ("k", k, "(K, S, D)"), ("v", v, "(K, S, E)")):
        shape = tuple(x.shape)
        if len(shape) != 3:
            raise ValueError(
                f"{name} should have rank 3 {letters} (packed: every document's tokens one "
                f"after another), got rank {len(shape)} with shape {shape}"
            )
    call = check(q, k, v, **options)
    cu_q, cu_k = check_boundaries(cu_seqlens_q, cu_seqlens_k, call.T, call.S)
    return call, cu_q, cu_k


def check_boundaries(
    cu_seqlens_q: Any, cu_seqlens_k: Any, T: int, S: int
) -> tuple[list[int], list[int]]:
    """Both boundary arrays of a packed call (SPEC §18.1), as Python ints: each checked by
    ``check_cu_seqlens``, and the same number of documents N in both."""
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, T, "T")
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, S, "S")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_k should have the same number of documents N as cu_seqlens_q, "
            f"shape (N + 1,) = ({len(cu_q)},), got shape ({len(cu_k)},)"
        )
    return cu_q, cu_k


def check_cu_seqlens(name: str, cu_seqlens: Any, total: int, letter: str) -> list[int]:
    """The boundaries of packed documents as Python ints: a 1-D integer array (N + 1,),
    starting at 0, nondecreasing, ending at ``total`` (T for queries, S for keys)."""
    expected = f"a 1-D integer array (N + 1,) from 0 to {letter} = {total}, nondecreasing"
    if not (hasattr(cu_seqlens, "shape") and hasattr(cu_seqlens, "dtype")):
        raise TypeError(
            f"{name} should be {expected}, got {type(cu_seqlens).__name__} {cu_seqlens!r}"
        )
    dtype = dtype_name(cu_seqlens)
    if "int" not in dtype:  # int8 ... int64 and uint*; bool and floats are not lengths
        raise TypeError(f"{name} dtype should be an integer dtype, got {dtype}")
    shape = tuple(cu_seqlens.shape)
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{name} shape should be (N + 1,) with N >= 0, got {shape}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"{name} should start at 0, got {bounds[0]} in {bounds}")
    for n in range(len(bounds) - 1):
        if bounds[n + 1] < bounds[n]:
            raise ValueError(
                f"{name} should be nondecreasing (document lengths >= 0), got "
                f"{bounds[n + 1]} after {bounds[n]} at index {n + 1} in {bounds}"
            )
    if bounds[-1] != total:
        raise ValueError(f"{name} should end at {letter} = {total}, got {bounds[-1]} in {bounds}")
    return bounds


@dataclass(frozen=True)
class PagedChecked:
    """What ``check_paged`` found: the sizes, each sequence's length and the pages it reads
    (``pages[b]``: its table's first ⌈seq_lens[b] / L⌉ entries), and the options."""

    B: int
    H: int
    K: int
    G: int
    T: int
    D: int
    E: int
    N: int
    L: int
    M: int
    seq_lens: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]
    is_causal: bool
    scale: float
    window: tuple[int | None, int | None] | None
    softcap: float | None


def check_paged(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_table: Any,
    seq_lens: Any,
    *,
    is_causal: Any = False,
    scale: Any = None,
    window: Any = None,
    softcap: Any = None,
    d_out: Any = None,
) -> PagedChecked:
    """Check one paged call (SPEC §19); return its sizes, lengths and pages.

    The table and the lengths are read as values (``.tolist()``, which NumPy, torch and
    concrete JAX arrays all have), so an impl calls this before it traces or compiles.

    Raises:
      ValueError, TypeError: bad input, naming the argument, what was expected and what
        was given (SPEC §8, §19.5).
    """
    qs, ks, vs = (tuple(x.shape) for x in (q, k_pages, v_pages))
    if len(qs) != 4:
        raise ValueError(f"q should have rank 4 (B, H, T, D), got rank {len(qs)} with shape {qs}")
    for name, shape, letters in (("k_pages", ks, "(N, K, L, D)"), ("v_pages", vs, "(N, K, L, E)")):
        if len(shape) != 4:
            raise ValueError(
                f"{name} should have rank 4 {letters}, got rank {len(shape)} with shape {shape}"
            )
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not is_floating(dtype_name(x)):
            raise TypeError(f"{name} should be a floating array, got dtype {dtype_name(x)}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if dtype_name(x) != dtype_name(q):
            raise TypeError(f"{name} dtype should be {dtype_name(q)} like q, got {dtype_name(x)}")
    B, H, T, D = qs
    N, K, L, _ = ks
    E = vs[-1]
    if K == 0 or H % K != 0:
        raise ValueError(
            f"k_pages heads K={K} should divide q heads H={H} (grouped-query attention), "
            f"got k_pages shape {ks}"
        )
    if ks != (N, K, L, D):
        raise ValueError(
            f"k_pages shape should be (N, K, L, D) = {(N, K, L, D)} to match q {qs}, got {ks}"
        )
    if vs[:3] != (N, K, L):
        raise ValueError(
            f"v_pages shape should be (N, K, L, E) = {(N, K, L, E)} to match k_pages {ks}, got {vs}"
        )
    if L < 1:
        raise ValueError(f"k_pages should have L >= 1 slots per page, got shape {ks}")
    table = _check_index_array("block_table", block_table, "(B, M)", 2, B)
    lens = _check_index_array("seq_lens", seq_lens, "(B,)", 1, B)
    M = tuple(block_table.shape)[1]
    pages = []
    for b, n in enumerate(lens):
        if not 0 <= n <= M * L:
            raise ValueError(
                f"seq_lens[{b}] should lie in [0, M·L] = [0, {M * L}] (M = {M} table entries "
                f"of L = {L} slots), got {n}"
            )
        used = table[b][: -(-n // L)]  # the ⌈n / L⌉ pages sequence b reads
        for j, page in enumerate(used):
            if not 0 <= page < N:
                raise ValueError(
                    f"block_table[{b}, {j}] should be a page in [0, N) = [0, {N}) since "
                    f"sequence {b} reads it (seq_lens[{b}] = {n}), got {page}"
                )
        pages.append(tuple(used))
    is_causal = check_bool("is_causal", is_causal)
    if is_causal:
        for b, n in enumerate(lens):
            if n < T:
                raise ValueError(
                    f"seq_lens[{b}] should be at least T = {T} with is_causal (the queries "
                    f"are the last T positions of each sequence), got {n}"
                )
    window = check_window(window)
    softcap = None if softcap is None else check_softcap(softcap, dtype_name(q))
    scale = 1.0 / math.sqrt(D) if scale is None else positive("scale", scale)
    if d_out is not None:
        check_d_out(d_out, (B, H, T, E), dtype_name(q))
    return PagedChecked(
        B=B,
        H=H,
        K=K,
        G=H // K,
        T=T,
        D=D,
        E=E,
        N=N,
        L=L,
        M=M,
        seq_lens=tuple(lens),
        pages=tuple(pages),
        is_causal=is_causal,
        scale=scale,
        window=window,
        softcap=softcap,
    )


def _check_index_array(name: str, x: Any, letters: str, rank: int, B: int) -> list:
    """An integer array of shape ``letters`` with B rows, as nested Python ints."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} should be an integer array {letters}, got {type(x).__name__}")
    dtype = dtype_name(x)
    if "int" not in dtype:  # int8-64, uint8-64; bool and floats are not indices
        raise TypeError(f"{name} dtype should be an integer dtype, got {dtype}")
    shape = tuple(x.shape)
    if len(shape) != rank or shape[0] != B:
        want = "(B, M)" if rank == 2 else f"(B,) = ({B},)"
        raise ValueError(f"{name} shape should be {want} with B = {B} like q, got {shape}")
    return (
        [int(n) for n in x.tolist()] if rank == 1 else [[int(n) for n in row] for row in x.tolist()]
    )


# --- The one rule for numbers ----------------------------------------------------------------
