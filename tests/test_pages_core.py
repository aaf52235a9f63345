"""Each parallel core page's ``textbook_attention`` is its ``attention()``, read without options.

A core page opens with attention as every course writes it (scores = q kᵀ · scale, the
causal triangle and blocked keys to -inf, softmax, weights · v), and ``attention()`` runs
those lines with every option as a step between them. Here the two are held equal, value
for value, on every stored fixture that the core takes: batched float64 or float32 inputs,
as many key/value heads as query heads, finite q, k and v, at least one key, and no option
but the scale, causality and a bool mask. Top-left causality is the core's own
``is_causal`` (its ``tril``); bottom-right is given to it as the shifted triangle, a bool
mask. Where they differ, by design: a row with no key left is NaN in the core (the
formula's 0 / 0) and 0 in ``attention()``; both are checked. The fixtures' expected
outputs are the oracle's, checked elsewhere.
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
    if shape["S"] == 0:
        return False  # no key at all: the textbook's row maximum has nothing to take
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


#: How far the core may lie from attention() on a row both define, in units of max |v|:
#: nothing for NumPy and PyTorch, which run the same operations. In JAX both are XLA
#: programs, which may contract step 2's multiply into the softmax's subtraction (a fused
#: multiply-add, one rounding fewer); attention() then shifts a second time to undo it (its
#: Edge cases: fused multiply-add), the core does not. An exponent then differs by at most
#: an ulp of its score, each weight by a few ulps relative, the weighted sum of values by
#: as many ulps of max |v|: 4 float64 ulps of 1 bound it (seen: 1).
_ROUNDING = {"numpy": 0.0, "torch-naive": 0.0, "jax": 4 * np.finfo(np.float64).eps}


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
    is_causal, given = bool(options.get("is_causal")), mask
    if is_causal and options.get("causal_alignment", "top_left") != "top_left":
        is_causal, shifted = False, _causal(T, S, "bottom_right")  # (T, S)
        given = shifted if mask is None else shifted & mask
    allowed = np.ones((T, S), dtype=bool) if given is None else given  # (B|1, H|1, T, S)
    if is_causal:
        allowed = allowed & _causal(T, S, "top_left")
    has_key = np.broadcast_to(np.asarray(allowed).any(axis=-1), q.shape[:-1])  # (B, H, T)
    core, scale = module.textbook_attention, options.get("scale")
    if page == "jax":
        # Compiled, one program a fixture (not one per operation), and given the scale as
        # a traced number of q's dtype, as attention() compiles it.
        import jax

        core = jax.jit(core, static_argnames=("is_causal",))
        scale = to(np.asarray(scale or 1 / math.sqrt(q.shape[-1]), q.dtype))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        core = back(
            core(to(q), to(k), to(v), None if given is None else to(given), is_causal, scale)
        )
    full = back(
        module.attention(to(q), to(k), to(v), mask=None if mask is None else to(mask), **options)
    )
    np.testing.assert_allclose(
        core[has_key], full[has_key], rtol=0, atol=_ROUNDING[page] * np.abs(v).max(),
        err_msg=f"{page}: textbook_attention != attention on {case_id}",
    )  # fmt: skip
    assert np.isnan(core[~has_key]).all(), f"{page}: a row with no key is not NaN in the core"
    assert (full[~has_key] == 0).all(), f"{page}: a row with no key is not 0 in attention()"
