"""Framework-specific promises that the NumPy-in, NumPy-out interface cannot show:
each framework's KV-cache class, the torch module's eval mode, and torch's dropout
matching SDPA's (SPEC §5.2, §6.11)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conformance.impls.jax import kv_cache as jax_kv_cache
from conformance.impls.numpy import attention as numpy_attention
from conformance.impls.numpy import kv_cache as numpy_kv_cache
from conformance.impls.torch import kv_cache as torch_kv_cache
from conformance.impls.torch import layers as torch_layers
from conformance.impls.torch import module as torch_module
from conformance.impls.torch import naive as torch_naive
from conformance.impls.torch import sdpa as torch_sdpa

from conformance.backends.arrays import import_jax
from conformance.suite.helpers import random_qkv, random_tolerance
from conformance.suite.tolerance import assert_within


def _chunks(q, k, v, sizes):
    start = 0
    for n in sizes:
        yield (
            q[..., start : start + n, :],
            k[..., start : start + n, :],
            v[..., start : start + n, :],
        )
        start += n


@pytest.mark.clause("6.11")
@pytest.mark.parametrize("framework", ["numpy", "jax", "torch"])
def test_kv_cache_class_reproduces_full_causal(framework):
    jax = import_jax()  # float64 on, as in every JAX backend
    q, k, v = random_qkv(40, H=4, K=2, T=9, S=9)
    impl, wrap = {
        "numpy": (numpy_kv_cache, np.asarray),
        "jax": (jax_kv_cache, jax.numpy.asarray),
        "torch": (torch_kv_cache, torch.from_numpy),
    }[framework]
    cache = impl.KVCache()
    outs = [
        np.asarray(cache.attend(*(wrap(x) for x in chunk)))
        for chunk in _chunks(q, k, v, [3, 1, 1, 4])
    ]
    full = numpy_attention.attention(q, k, v, is_causal=True)
    assert_within(
        np.concatenate(outs, axis=-2),
        full,
        2 * random_tolerance(q, k, v, "float64", is_causal=True),
        f"{framework} KVCache",
    )


@pytest.mark.clause("5.1")
def test_module_dropout_is_off_in_eval_mode():
    torch.manual_seed(0)
    mha = torch_layers.MultiHeadAttention(12, 3, dropout=0.5).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    mha.eval()
    assert torch.equal(mha(x), mha(x))
    mha.train()
    torch.manual_seed(1)
    a = mha(x)
    torch.manual_seed(2)
    assert not torch.equal(a, mha(x))


@pytest.mark.clause("5.2")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_dropout_reproduces_sdpa(dtype):
    """With the same seed, naive and module dropout draw SDPA's mask: the weights each
    zeroes are the same, and the outputs agree to rounding."""
    q, k, v = (torch.from_numpy(x).to(dtype) for x in random_qkv(41, B=2, H=4, T=16, S=16, D=8))
    eye = torch.eye(16, dtype=dtype).expand(2, 4, 16, 16).contiguous()
    p = 0.3
    torch.manual_seed(7)
    sdpa_w = torch_sdpa.attention(q, k, eye, dropout_p=p)
    torch.manual_seed(7)
    naive_w = torch_naive.attention(q, k, eye, dropout_p=p)
    torch.manual_seed(7)
    module_w = torch_module.attention(q, k, eye, dropout=torch.nn.Dropout(p).train())
    assert torch.equal(sdpa_w == 0, naive_w == 0) and torch.equal(sdpa_w == 0, module_w == 0)
    tol = 4 * random_tolerance(
        *(x.double().numpy() for x in (q, k, eye)), str(dtype).removeprefix("torch.")
    )
    assert_within(naive_w.numpy(), sdpa_w.numpy(), tol, "naive vs SDPA dropout")
    assert_within(module_w.numpy(), sdpa_w.numpy(), tol, "module vs SDPA dropout")
