"""The lse's cotangent at the door (SPEC §21.7, §8): a d_lse not shaped like the lse is a
ValueError naming d_lse, one not in the lse's dtype a TypeError, and a backend that does
not declare "grad_lse" refuses d_lse by name, whatever it declares of the gradients."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import load_backend
from conformance.backends.numpy_backends import NumpyBackend
from conformance.suite.helpers import random_qkv

pytestmark = pytest.mark.clause("21.7")


def _call(dtype: str = "float32"):
    q, k, v = random_qkv(70, T=5, S=6, dtype=dtype)  # (2, 3, 5, 5), (2, 3, 6, 5), (2, 3, 6, 5)
    d_out = np.ones((2, 3, 5, 5), dtype=q.dtype)  # (B, H, T, E)
    return q, k, v, d_out


@pytest.mark.parametrize("name", ["numpy", "numpy-flash"])
def test_a_d_lse_of_the_wrong_shape_is_a_value_error_naming_it(name):
    q, k, v, d_out = _call()
    with pytest.raises(ValueError, match=r"d_lse shape should be the lse's \(B, H, T\)"):
        load_backend(name).attention_vjp(q, k, v, d_out, d_lse=np.zeros((2, 3, 6), np.float32))


@pytest.mark.parametrize("name", ["numpy", "numpy-flash"])
def test_a_d_lse_in_another_dtype_than_the_lse_s_is_a_type_error_naming_it(name):
    # float16 q: the lse, and so d_lse, is float32 (SPEC §21.4).
    q, k, v, d_out = _call("float16")
    with pytest.raises(TypeError, match="d_lse dtype should be float32"):
        load_backend(name).attention_vjp(q, k, v, d_out, d_lse=np.zeros((2, 3, 5), np.float16))
    grads = load_backend(name).attention_vjp(q, k, v, d_out, d_lse=np.zeros((2, 3, 5), np.float32))
    assert [g.dtype for g in grads] == [np.float16] * 3


def test_a_backend_with_grad_but_not_grad_lse_refuses_d_lse_by_name():
    class GradOnly(NumpyBackend):
        name = "numpy-grad-only"
        capabilities = NumpyBackend.capabilities - {"grad_lse"}

    q, k, v, d_out = _call()
    with pytest.raises(NotImplementedError, match=r"d_lse .*'grad_lse' capability"):
        GradOnly().attention_vjp(q, k, v, d_out, d_lse=np.zeros((2, 3, 5), np.float32))
    assert len(GradOnly().attention_vjp(q, k, v, d_out)) == 3  # the plain backward still runs
