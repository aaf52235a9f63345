"""The kit's log-sum-exp (SPEC §21): a profile's ``[lse]`` table says where a function's
result holds its lse, in which layout and base, and the suite gets (B, H, T) in the natural
log; a table with a wrong key is refused by name."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
from conformance.impls.numpy import attention as page

from conformance.adapters.lse import LseForm, parse_lse
from conformance.adapters.profiles import ProfileError, read_profile
from conformance.suite.helpers import random_qkv

pytestmark = pytest.mark.clause("21.1")

#: A function in the (B, T, H, D) layout that returns a dict with the lse in base 2,
#: (B, T, H), when asked by its keyword ``with_lse``: FlashInfer's kind of return.
MODULE = """
import numpy as np
from conformance.impls.numpy import attention as page


def attend(q, k, v, *, is_causal=False, scale=None, with_lse=False):
    q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    out, lse = page.attention(q, k, v, is_causal=is_causal, scale=scale, return_lse=True)
    out = np.swapaxes(out, 1, 2)
    if not with_lse:
        return out
    return {"o": out, "lse2": np.swapaxes(lse, 1, 2) / np.log(2.0)}
"""

PROFILE = """
name = "mine.lse"
target = "lse_kit_function:attend"
layout = "BTHD"
capabilities = ["lse"]

[options]
is_causal = "is_causal"
scale = "scale"

[mask]
bool = false
float = false

[forms]
masks = []

[lse]
key = "lse2"
out = "o"
keyword = "with_lse"
layout = "BTH"
base = "2"
"""


@pytest.fixture
def profile(tmp_path, monkeypatch):
    (tmp_path / "lse_kit_function.py").write_text(MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "mine.toml"
    path.write_text(PROFILE, encoding="utf-8")
    yield read_profile(path)
    sys.modules.pop("lse_kit_function", None)


def test_the_lse_comes_back_as_the_spec_has_it(profile):
    """Base 2 and (B, T, H) in a dict, asked for by a keyword: the suite gets the natural
    log in (B, H, T), the output beside it, and the output alone without return_lse."""
    backend = profile.resolve()
    q, k, v = random_qkv(222, T=7, S=13)
    out, lse = backend.attention(q, k, v, is_causal=True, return_lse=True)
    want_out, want_lse = page.attention(q, k, v, is_causal=True, return_lse=True)
    assert lse.shape == (2, 3, 7)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(out, want_out, rtol=1e-14, atol=1e-14)
    plain = backend.attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(plain, want_out, rtol=1e-14, atol=1e-14)


def test_a_function_without_lse_refuses_return_lse(profile):
    backend = profile.resolve()
    backend.capabilities = backend.capabilities - {"lse"}
    q, k, v = random_qkv(223, T=3, S=4)
    with pytest.raises(NotImplementedError, match="return_lse"):
        backend.attention(q, k, v, return_lse=True)


@pytest.mark.parametrize(
    "table, words",
    [
        ({"index": 1, "where": 0}, "unknown keys"),
        ({}, "one of index"),
        ({"index": 1, "key": "lse"}, "one of index"),
        ({"index": "1"}, "index should be an int"),
        ({"index": 1, "layout": "TBH"}, "layout should be one of"),
        ({"index": 1, "base": "10"}, "base should be one of"),
        ({"index": 1, "out": 1.5}, "out should be"),
    ],
)
def test_a_bad_lse_table_is_refused_by_name(table, words):
    with pytest.raises(ValueError, match=words):
        parse_lse(table, "mine.toml")


def test_lse_and_its_table_go_together(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        textwrap.dedent("""
            name = "mine"
            target = "numpy:add"
            capabilities = ["lse"]
        """),
        encoding="utf-8",
    )
    with pytest.raises(ProfileError, match=r"'lse' and the table \[lse\]"):
        read_profile(path)


def test_the_defaults_read_a_tuple():
    """Without ``out``, the output is the result's first item; BHT and base e by default."""
    form = LseForm(index=1)
    out, lse = form.split(("o", np.zeros((1, 2, 3))), asked=True, func_name="f")
    assert out == "o" and form.to_spec(lse).shape == (1, 2, 3)
