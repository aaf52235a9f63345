"""A page's function is what its signature says: each keyword it takes is honoured or refused.

A student copies ``attention`` from a page and calls it with its own keywords, not through
the suite's backend. Here each public attention function of the NumPy and PyTorch pages is
called that way, one keyword at a time: given a value other than its default, the keyword
changes the output, or the call is refused with an error that names it. The schedule
keywords (tile sizes, splits, the fast path) change how, not what: a bad value is refused
and a good one gives the same rows. JAX's pages are left to the suite, whose backends call
them with these keywords too, so that no test here compiles a program of its own; only
their switches are called here, with a value that is refused before anything compiles.

And the PyTorch module page's ``dropout_p``, which once was accepted and never used: it
draws as SDPA's math backend does, so after the same ``torch.manual_seed`` both drop the
same weights.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

#: The page functions a student may adopt, by the page's name.
PAGES = {
    "numpy": "conformance.impls.numpy.attention",
    "numpy-flash": "conformance.impls.numpy.flash",
    "numpy-split-kv": "conformance.impls.numpy.split_kv",
    "torch-naive": "conformance.impls.torch.naive",
    "torch-module": "conformance.impls.torch.module",
    "torch-sdpa": "conformance.impls.torch.sdpa",
    "torch-split-kv": "conformance.impls.torch.split_kv",
}
#: The JAX pages, called here only with a switch that is not a bool (refused before compiling).
JAX_PAGES = {
    "jax": "conformance.impls.jax.attention",
    "jax-flash": "conformance.impls.jax.flash",
    "jax-split-kv": "conformance.impls.jax.split_kv",
}
#: The random sources of dropout, by the keyword's name on the pages that take one.
RANDOM = ("rng", "generator", "dropout")
#: Keywords that choose how the rows are computed, not which: a good other value, a bad one
#: (a switch takes a bool and nothing else).
SCHEDULE = {"block_q": (1, 0), "block_k": (1, 0), "num_splits": (2, 0), "fast": (True, "yes")}
B, H, T, S, D = 1, 2, 3, 5, 4


def _framework(page: str):
    if page.startswith("numpy"):
        return np.asarray, np.asarray
    if page.startswith("jax"):
        import jax

        # device_put moves the bytes as they are: no program is compiled to make the input.
        return lambda x: jax.device_put(np.asarray(x, np.float32)), np.asarray
    import torch

    return torch.as_tensor, lambda x: x.detach().numpy()


def _source(page: str, n: int):
    """A fresh random source of seed ``n`` for ``page``'s dropout keyword."""
    if page.startswith("numpy"):
        return np.random.default_rng(n)
    import torch

    if page == "torch-module":
        return torch.nn.Dropout(0.5).train()
    return torch.Generator().manual_seed(n)


def _cases(page: str, parameters) -> dict[str, tuple[dict, dict]]:
    """For each keyword: the options of a plain call and of one where only that keyword (and
    what it needs to mean anything) differs."""
    rng = np.random.default_rng(0)
    mask = rng.random((T, S)) > 0.4
    mask[:, 0] = True  # every query keeps a key
    random = next((name for name in RANDOM if name in parameters), None)
    dropout = {"dropout_p": 0.5} | ({random: _source(page, 0)} if random == "rng" else {})
    if random == "generator":
        dropout[random] = _source(page, 0)
    cases = {
        "mask": ({}, {"mask": mask}),
        "is_causal": ({}, {"is_causal": True}),
        "scale": ({}, {"scale": 0.3}),
        "causal_alignment": (
            {"is_causal": True},
            {"is_causal": True, "causal_alignment": "bottom_right"},
        ),
        "window": ({}, {"window": (1, 0)}),
        "softcap": ({}, {"softcap": 0.2}),
        "dropout_p": ({}, dropout),
        "sinks": ({}, {"sinks": np.ones(H)}),
        "chunk_size": ({}, {"chunk_size": 2}),
        "alibi_slopes": ({}, {"alibi_slopes": np.full(H, 0.5)}),
        "return_lse": ({}, {"return_lse": True}),
        "return_weights": ({}, {"return_weights": True}),
    }
    if random in ("rng", "generator"):
        cases[random] = (dropout, dropout | {random: _source(page, 1)})
    if random == "dropout":
        cases[random] = ({}, {random: _source(page, 0)})
    return cases


def _keywords():
    for page, module in PAGES.items():
        parameters = inspect.signature(importlib.import_module(module).attention).parameters
        for name, parameter in parameters.items():
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
                yield pytest.param(page, name, id=f"{page}-{name}")


def _call(page: str, options: dict):
    to, back = _framework(page)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, H, n, D)) for n in (T, S, S))
    given = {
        name: to(value) if isinstance(value, np.ndarray) else value
        for name, value in options.items()
    }
    if page.startswith("torch"):
        import torch

        torch.manual_seed(0)  # the global generator, for the pages that draw from it
    page_module = importlib.import_module({**PAGES, **JAX_PAGES}[page])
    out = page_module.attention(to(q), to(k), to(v), **given)
    return tuple(back(x) for x in out) if isinstance(out, tuple) else (back(out),)


def _refused_by_name(page: str, options: dict, name: str) -> bool:
    """Whether the call with ``options`` is refused by an error that names ``name``."""
    try:
        _call(page, options)
    except (NotImplementedError, ValueError, TypeError) as error:
        assert name in str(error), f"{page}: {name} refused by {error!r}, which does not name it"
        return True
    return False


@pytest.mark.parametrize("page, name", list(_keywords()))
def test_each_keyword_is_honoured_or_refused(page, name):
    parameters = inspect.signature(importlib.import_module(PAGES[page]).attention).parameters
    if name in SCHEDULE:
        other, bad = SCHEDULE[name]
        assert _refused_by_name(page, {name: bad}, name), f"{page}: {name}={bad!r} is accepted"
        np.testing.assert_allclose(
            _call(page, {name: other})[0], _call(page, {})[0], rtol=1e-12, atol=1e-12,
            err_msg=f"{page}: {name}={other!r} changes the rows",
        )  # fmt: skip
        return
    cases = _cases(page, parameters)
    assert name in cases, f"{page} takes {name}, which this test does not know: add it"
    plain, changed = cases[name]
    if _refused_by_name(page, changed, name):
        return
    before, after = _call(page, plain), _call(page, changed)
    same = len(before) == len(after) and all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after)
    )
    assert not same, f"{page}: attention(..., {name}=...) returns what it returns without it"


def _switches():
    for page, module in {**PAGES, **JAX_PAGES}.items():
        parameters = inspect.signature(importlib.import_module(module).attention).parameters
        for name, parameter in parameters.items():
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is False:
                yield pytest.param(page, name, id=f"{page}-{name}")


@pytest.mark.parametrize("page, name", list(_switches()))
def test_a_switch_takes_a_bool_and_nothing_else(page, name):
    """``fast="yes"`` once ran the fast path, and ``return_lse="no"`` returned the lse: a
    switch given anything but a bool is refused with a TypeError that names it, what it
    expects and what it got (SPEC §8.1)."""
    with pytest.raises(TypeError, match=rf"^{name} should be a bool, got 'yes'$"):
        _call(page, {name: "yes"})


def test_the_module_pages_dropout_p_draws_as_sdpa_does():
    """``module.attention(q, k, v, dropout_p=p)`` after ``torch.manual_seed(s)`` is SDPA's
    math backend with the same p and seed: the same weights dropped, the same rescale."""
    import torch
    import torch.nn.functional as F
    from conformance.impls.torch import module
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = np.random.default_rng(2)
    q, k, v = (torch.as_tensor(rng.standard_normal((B, H, n, D))) for n in (T, S, S))
    torch.manual_seed(7)
    out = module.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)
    assert not torch.equal(out, module.attention(q, k, v)), "dropout_p=0.5 dropped nothing"


def test_the_module_page_refuses_dropout_p_and_a_dropout_callable_together():
    import torch
    from conformance.impls.torch import module

    q = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="dropout_p and dropout: give one"):
        module.attention(q, q, q, dropout_p=0.5, dropout=torch.nn.Dropout(0.5))


def test_the_naive_page_refuses_weights_and_lse_together():
    """Both ask for the second output: the page once returned the lse and dropped the
    weights without a word."""
    import torch
    from conformance.impls.torch import naive

    q = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="return_weights and return_lse"):
        naive.attention(q, q, q, return_weights=True, return_lse=True)


class _Called(Exception):
    """Raised by the spy in place of the page's work: the call is what is under test."""


#: The core pages' backends, and the page keyword their random source arrives as.
CORE_BACKENDS = {
    "numpy": "rng",
    "torch-naive": "generator",
    "torch-module": None,
    "torch-sdpa": None,
    "jax": "key",
}


@pytest.mark.parametrize("name", sorted(CORE_BACKENDS))
def test_the_suite_calls_the_core_page_by_its_own_keywords(name, monkeypatch):
    """What the suite runs on a core page's backend is the page's ``attention`` called as
    its signature says: every option by its own keyword, with the value given, and the
    seed as the page's random source (the global generator where it has none)."""
    from conformance import load_backend

    backend = load_backend(name)
    calls = []

    def spy(q, k, v, **options):
        calls.append(options)
        raise _Called

    monkeypatch.setattr(backend.impl, "attention", spy)
    options = dict(
        is_causal=True, scale=0.5, causal_alignment="bottom_right", window=(2, 0),
        softcap=3.0, dropout_p=0.25,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, n, 4)) for n in (3, 5, 5))
    mask = rng.random((3, 5)) > 0.3  # (T, S)
    with pytest.raises(_Called):
        backend.attention(q, k, v, mask=mask, seed=3, **options)
    (given,) = calls
    assert np.array_equal(np.asarray(given.pop("mask")), mask), f"{name}: the mask changed"
    random = CORE_BACKENDS[name]
    assert given.pop(random, None) is not None if random else True, f"{name}: no {random}"
    assert given == options, f"{name} calls its page with {given}, not {options}"
