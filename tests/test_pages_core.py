"""Each parallel core page's ``textbook_attention`` is its ``attention()``, read without options.

A core page opens with attention as the seed notes write it (scores = q kᵀ · scale, blocked
keys to -inf, softmax, weights · v), and ``attention()`` runs those lines with every option
as a step between them. Here the two are held equal, value for value (NaN where NaN), on
every stored fixture that the core takes: batched float64 or float32 inputs, as many
key/value heads as query heads, finite q, k and v, and no option but the scale, causality
and a bool mask. The causal triangle is given to the core as the bool mask that every
course draws, ``tril``; the fixtures' expected outputs are the oracle's, checked elsewhere.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from conformance.suite.cases import case_entries, load_case

PAGES = {
    "numpy": "conformance.impls.numpy.attention",
    "jax": "conformance.impls.jax.attention",
    "torch-naive": "conformance.impls.torch.naive",
}
#: What ``textbook_attention`` has no parameter for.
VARIANTS = ("window", "softcap", "chunk_size")


def _takes(entry: dict) -> bool:
    shape, options = entry["shape"], entry["options"]
    if entry["dtype"] not in ("float64", "float32") or entry.get("unbatched"):
        return False
    if shape.get("K", shape["H"]) != shape["H"] or {"sinks", "alibi"} & set(entry):
        return False
    if any(options.get(name) is not None for name in VARIANTS):
        return False
    case = load_case(entry["id"])
    mask = case.mask()
    if mask is not None and mask.dtype != np.bool_:
        return False
    return all(np.isfinite(x).all() for x in case.inputs())


CASES = [e["id"] for e in case_entries() if _takes(e)]
#: JAX compiles a program per fixture shape here, so it runs the float64 half: every shape.
JAX_CASES = [c for c in CASES if c.endswith("float64")]


def _causal(T: int, S: int, alignment: str) -> np.ndarray:
    """Query t sees key s <= t, or s <= t + S - T bottom-right."""
    return np.tril(np.ones((T, S), dtype=bool), k=0 if alignment == "top_left" else S - T)


def _page(name: str):
    if name == "jax":
        from conformance.backends.arrays import import_jax

        import_jax()  # float64 on, as the suite has it
    return importlib.import_module(PAGES[name])


def _framework(name: str):
    if name == "numpy":
        return np.asarray, np.asarray
    if name == "jax":
        import jax.numpy as jnp

        return jnp.asarray, np.asarray
    import torch

    return torch.as_tensor, lambda x: x.numpy()


def test_the_core_takes_enough_fixtures():
    assert len(CASES) >= 30, f"the core takes only {len(CASES)} fixtures: {CASES}"


@pytest.mark.parametrize(
    "page, case_id", [(p, c) for p in PAGES for c in (JAX_CASES if p == "jax" else CASES)]
)
def test_the_core_is_attention_without_options(page, case_id):
    case = load_case(case_id)
    module = _page(page)
    to, back = _framework(page)
    q, k, v = case.inputs()
    mask, options = case.mask(), case.options()
    T, S = q.shape[-2], k.shape[-2]
    allowed = None
    if options.get("is_causal"):
        allowed = _causal(T, S, options.get("causal_alignment", "top_left"))  # (T, S)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    core, scale = module.textbook_attention, options.get("scale")
    if page == "jax":
        # Compiled, and given the scale as a traced number, as attention() compiles it: XLA
        # rounds a fused program differently from the same operations one by one.
        import jax

        core, scale = jax.jit(core), to(np.asarray(scale or 1 / math.sqrt(q.shape[-1]), q.dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        core = core(to(q), to(k), to(v), None if allowed is None else to(allowed), scale)
    full = module.attention(to(q), to(k), to(v), mask=None if mask is None else to(mask), **options)
    np.testing.assert_array_equal(
        back(core), back(full), err_msg=f"{page}: textbook_attention != attention on {case_id}"
    )
