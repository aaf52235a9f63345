"""OpenVINO's ``ScaledDotProductAttention`` operator (opset 13) as a function of arrays:
the adapter the ``openvino.ScaledDotProductAttention`` profile calls.

OpenVINO has no function to call: an operator runs inside a model compiled for a device.
For each signature of a call (the dtypes, the rank, whether a mask and a scale are given,
``causal``) this builds the smallest model, one ``ScaledDotProductAttention`` node with
``openvino.opset13``, compiles it for the CPU plugin (``ov.Core().compile_model(model, "CPU", config)``, the
config asking for f32 inference precision) and runs the ``CompiledModel`` on NumPy
arrays. Dimensions are dynamic, so one compiled model serves every shape; models are
cached per signature. Ranks are fixed per model: a mask of dynamic rank does not compile
("Cannot get length of dynamic dimension", measured).

The keywords are the operator's own: ``attention_mask`` (bool, True = attend, or
additive), ``scale`` (an input, a scalar of q's dtype) and ``causal``. Nothing is
converted: the arrays go in and come out as the compiled model returns them.

OpenVINO letters: query [N, ..., L, E] is q (B, H, T, D); key [N, ..., S, E] and value
[N, ..., S, Ev] are k and v (E = Ev here: the spec's E is OpenVINO's Ev).
"""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=256)
def _compiled(dtypes: tuple[str, ...], ranks: tuple[int, ...], has_scale: bool, causal: bool):
    import openvino as ov
    import openvino.opset13 as ops

    def parameter(name, dtype, shape):
        return ops.parameter(shape, ov.Type(np.dtype(dtype)), name=name)

    names = ("query", "key", "value", "attention_mask")
    params = [parameter(n, d, ov.PartialShape.dynamic(r)) for n, d, r in zip(names, dtypes, ranks)]
    q, k, v, mask = (*params, None)[:4]
    scale = None
    if has_scale:
        scale = parameter("scale", dtypes[0], ov.PartialShape([]))
        params.append(scale)
    node = ops.scaled_dot_product_attention(q, k, v, mask, scale, causal=causal)
    # The CPU plugin's default precision depends on the processor: bf16 where it has AMX or
    # AVX512_BF16 (measured on such a Xeon: float32 outputs rounded to bf16), f32 elsewhere.
    # f32, the setting OpenVINO documents for accuracy, is the same on every processor.
    return ov.Core().compile_model(
        ov.Model([node], params), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    *,
    attention_mask: np.ndarray | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> np.ndarray:
    """The CPU plugin's ``ScaledDotProductAttention``: the output for query, key, value."""
    arrays = [np.asarray(query), np.asarray(key), np.asarray(value)]
    if attention_mask is not None:
        arrays.append(np.asarray(attention_mask))
    if scale is not None:
        arrays.append(np.asarray(scale, dtype=arrays[0].dtype))
    given = arrays[: 3 + (attention_mask is not None)]
    dtypes, ranks = tuple(a.dtype.name for a in given), tuple(a.ndim for a in given)
    compiled = _compiled(dtypes, ranks, scale is not None, bool(causal))
    return compiled(arrays)[0]
