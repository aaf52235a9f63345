"""How the adapter calls a kernel beyond its keywords: a scale passed on every call
(``[call] scale = "always"``, SPEC §13.10), for kernels whose own default is not the spec's
or that require one."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conformance.impls.numpy.attention import attention as reference

from conformance.adapters.impl import FunctionBackend
from conformance.adapters.native import OptionMap
from conformance.suite.helpers import oracle_attention, random_qkv


def _needs_scale(received: list):
    def kernel(q, k, v, *, sm_scale):
        """A kernel with no default scale: it requires one on every call."""
        received.append(sm_scale)
        return reference(q, k, v, scale=sm_scale)

    return kernel


@pytest.mark.clause("13.10")
def test_a_kernel_that_requires_a_scale_is_always_passed_one():
    received: list = []
    call = OptionMap(
        options={"scale": "sm_scale"}, mask_bool=None, mask_float=None, causal="none",
        scale="always",
    )  # fmt: skip
    backend = FunctionBackend(_needs_scale(received), name="needs-scale", call=call)
    q, k, v = random_qkv(0, B=1, H=2, T=3, S=5, D=4)
    out = backend.attention(q, k, v)
    assert received == [0.5]  # 1/sqrt(4), the spec's default
    np.testing.assert_allclose(out, oracle_attention(q, k, v), rtol=0, atol=1e-13)
    backend.attention(q, k, v, scale=0.3)
    assert received[-1] == 0.3  # a scale the call sets is passed as it is
    # Without "always" the kernel gets no scale and fails as its users would see it.
    plain = FunctionBackend(
        _needs_scale([]), name="plain", call=OptionMap(
            options={"scale": "sm_scale"}, mask_bool=None, mask_float=None, causal="none"
        ),
    )  # fmt: skip
    with pytest.raises(TypeError, match="sm_scale"):
        plain.attention(q, k, v)


def test_always_needs_a_scale_keyword():
    with pytest.raises(ValueError, match="needs a keyword for scale"):
        OptionMap(options={}, mask_bool=None, mask_float=None, causal="none", scale="always")
    with pytest.raises(ValueError, match="when_set, always"):
        OptionMap(scale="never")
    assert OptionMap(scale="always").with_scale({}, np.zeros((1, 1, 2, 9))) == {
        "scale": 1 / math.sqrt(9)
    }
