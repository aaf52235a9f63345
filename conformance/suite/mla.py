"""The calls of the MLA fixtures (SPEC §4.11, §4.12, §19.7), built from their shared file.

Every MLA case lives in one file (``fixtures/mla_cases.py``); a manifest entry names the
arrays of the file it uses (``entry["arrays"]``). V is no array of the file: it is K's
first E columns, handed to the backend as that view of K, as MLA's kernels read it from
one cache.
"""

from __future__ import annotations

import numpy as np

from conformance.suite.cases import Case
from conformance.vocabulary import numpy_dtype

#: What an unread page of the paged case holds: finite, and far from every real key
#: (q's first channel is 64), so that a backend that reads it shows.
UNREAD_PAGE = 8.0


def array(case: Case, role: str) -> np.ndarray:
    """The array of the case's file that plays ``role`` ("q", "k", "mask", "expected", ...)
    in its call, as stored (float64 values exact in bfloat16)."""
    return case.arrays[case.meta["arrays"][role]]


def expected(case: Case) -> np.ndarray:
    """The oracle's output for the case's call, float64."""
    return array(case, "expected")


def dense_call(case: Case) -> tuple[tuple[np.ndarray, ...], dict]:
    """((q, k, v), options) of a dense case in its dtype: q (1, H, T, D), k (1, 1, S, D)
    (the cache's first S keys), v = k[..., :E] (1, 1, S, E); options with the mask, if any,
    in the case's dtype (a bool mask as it is)."""
    sh, dt = case.meta["shape"], numpy_dtype(case.dtype)
    q = array(case, "q").astype(dt)  # (1, H, T, D)
    k = array(case, "k")[:, :, : sh["S"]].astype(dt)  # (1, 1, S, D)
    v = k[..., : sh["E"]]  # (1, 1, S, E)
    options = dict(case.meta["options"])
    if "mask" in case.meta["arrays"]:
        mask = array(case, "mask")
        options["mask"] = mask if mask.dtype == np.bool_ else mask.astype(dt)
    return (q, k, v), options


def paged_call(case: Case) -> tuple[tuple[np.ndarray, ...], dict]:
    """((q, k_pages, v_pages, block_table, seq_lens), options) of the paged case: the cache
    cut into pages of L slots, page ``block_table[0, j]`` holding keys j·L … (j + 1)·L − 1
    (sequence 0 reads them all in table order), the pages no table names ``UNREAD_PAGE``
    in every entry; v_pages = k_pages[..., :E]."""
    sh, dt = case.meta["shape"], numpy_dtype(case.dtype)
    N, L = sh["N"], sh["L"]
    k = array(case, "k")  # (1, 1, S, D)
    table = array(case, "block_table")  # (B, M)
    k_pages = np.full((N, 1, L, sh["D"]), UNREAD_PAGE)  # (N, 1, L, D)
    for j, page in enumerate(table[0]):
        k_pages[page, 0] = k[0, 0, j * L : (j + 1) * L]
    k_pages = k_pages.astype(dt)
    v_pages = k_pages[..., : sh["E"]]  # (N, 1, L, E)
    q = array(case, "q").astype(dt)  # (B, H, 1, D)
    arrays = (q, k_pages, v_pages, table, array(case, "seq_lens"))
    return arrays, dict(case.meta["options"])


def reproduce(case: Case, backend, entry_point: str) -> str:
    """A snippet that reruns the case on ``backend``, for failure messages."""
    from conformance.suite.replay import load_expression

    builder = "paged_call" if entry_point == "attention_paged" else "dense_call"
    return (
        "from conformance.suite.cases import load_case; "
        f"from conformance.suite.mla import {builder}\n"
        f"    backend = {load_expression(backend)}\n"
        f"    arrays, options = {builder}(load_case({case.id!r}))\n"
        f"    backend.{entry_point}(*arrays, **options)"
    )
