"""The ONNX ``Attention`` operator as a function of arrays: the adapter the ONNX profiles
(``onnxruntime.Attention``, ``onnx.reference.Attention``) call.

ONNX has no function to call: an operator runs inside a model. For each signature of a
call (dtypes, ranks, which inputs are given, the attribute values) this builds the
smallest model, one ``Attention`` node (opset 25), with ``onnx.helper``, and runs it on
ONNX Runtime's ``CPUExecutionProvider`` or on the ``onnx.reference`` evaluator. Sessions
are cached per signature, so a run of the suite builds each model once. Dimensions are
left symbolic, so one model serves every shape.

The keywords are the operator's own (``attn_mask``, ``is_causal``, ``scale``,
``softcap``, ``left_window_size``, ``right_window_size``); the values go into the node as
they are, except what ONNX spells differently: ``is_causal`` is an int attribute, and an
unbounded window side is -1 rather than None. Nothing else is converted: the arrays go
in and come out as the operator returns them.

ONNX letters: Q (batch_size, q_num_heads, q_sequence_length, head_size) is q (B, H, T, D);
kv_num_heads is K, kv_sequence_length S, v_head_size E.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

OPSET = 25


def _model(dtypes: tuple[str, ...], attributes: tuple[tuple[str, Any], ...]):
    """One Attention node: inputs Q, K, V (and attn_mask), output Y; shapes symbolic."""
    from onnx import helper

    names = ["Q", "K", "V", "attn_mask"][: len(dtypes)]
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(d)), None)
        for n, d in zip(names, dtypes)
    ]
    output = helper.make_tensor_value_info(
        "Y", helper.np_dtype_to_tensor_dtype(np.dtype(dtypes[2])), None
    )
    node = helper.make_node("Attention", names, ["Y"], **dict(attributes))
    graph = helper.make_graph([node], "attention", inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


@functools.lru_cache(maxsize=256)
def _ort_session(dtypes, attributes):
    import onnxruntime

    model = _model(dtypes, attributes).SerializeToString()
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=256)
def _reference_evaluator(dtypes, attributes):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(_model(dtypes, attributes))


def _signature(q, k, v, attn_mask, is_causal, scale, softcap, left, right):
    arrays = [q, k, v] + ([] if attn_mask is None else [attn_mask])
    attributes = {"is_causal": int(bool(is_causal))}
    if scale is not None:
        attributes["scale"] = float(scale)
    if softcap is not None:
        attributes["softcap"] = float(softcap)
    if left is not None or right is not None:
        attributes["left_window_size"] = -1 if left is None else int(left)
        attributes["right_window_size"] = -1 if right is None else int(right)
    feeds = dict(zip(["Q", "K", "V", "attn_mask"], arrays))
    return tuple(np.asarray(a).dtype.name for a in arrays), tuple(attributes.items()), feeds


def onnxruntime_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """ONNX Runtime's CPU kernel for ``Attention``: Y for Q, K, V (and attn_mask)."""
    left, right = window if window is not None else (None, None)
    dtypes, attributes, feeds = _signature(
        q, k, v, attn_mask, is_causal, scale, softcap, left, right
    )
    return _ort_session(dtypes, attributes).run(["Y"], feeds)[0]


def reference_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """The ``onnx.reference`` evaluator's ``Attention`` (the operator's Python reference)."""
    left, right = window if window is not None else (None, None)
    dtypes, attributes, feeds = _signature(
        q, k, v, attn_mask, is_causal, scale, softcap, left, right
    )
    return _reference_evaluator(dtypes, attributes).run(["Y"], feeds)[0]
