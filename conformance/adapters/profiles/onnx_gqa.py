"""ONNX Runtime's ``GroupQueryAttention`` contrib operator (domain ``com.microsoft``) as a
function of arrays: the adapter the ``onnxruntime.GroupQueryAttention`` profile calls.

The operator is the attention of ONNX Runtime's LLM models (onnxruntime-genai exports it
for Llama, Mistral, Phi, gpt-oss): a KV-cache step. It takes the new tokens packed as
(batch, sequence, heads * head_size), the cache before the step in ``past_key`` and
``past_value`` (BNSH: batch, kv heads, length, head_size), ``seqlens_k`` (the total length
minus one, per batch entry) and ``total_sequence_length``, and returns the output and the
cache after the step (``present_key``, ``present_value``). The new tokens' keys come after
the past ones, so a causal mask puts the last query on the last key: bottom-right.

For each signature of a call (dtypes, which inputs are given, the attribute values) this
builds one ``GroupQueryAttention`` node with ``onnx.helper`` and runs it on the
``CPUExecutionProvider``; sessions are cached per signature and dimensions left symbolic.
The spec's call becomes the operator's like this, and nothing else is converted:

    q (B, T, H, D)      query (B, T, H*D), num_heads = H        (the profile's layout BTHD)
    k, v (B, S, K, *)   the last T keys: key, value (B, T, K*D); the first S - T:
                        past_key, past_value (B, K, S - T, D); kv_num_heads = K;
                        seqlens_k = S - 1 for every batch entry, total_sequence_length = S.
                        With T > S every key is new and there is no past (the operator
                        refuses it: a step cannot have more new keys than keys).
    is_causal           causal = 0 or 1 (the attribute; its default, 1, is never relied on)
    causal_alignment    "bottom_right" only: the operator's one alignment (past first);
                        "top_left" is refused where it differs (T != S)
    window (l, 0)       causal = 1, local_window_size = l + 1 (None: -1): the operator's
                        window counts the keys a query sees, its own included (Mistral's
                        sliding_window); its only side is the left one, and only with
                        causal = 1. (l, None) is that too when is_causal. Any other right
                        side raises NotImplementedError naming the window.
    scale, softcap      the attributes scale, softcap, as given
    sinks (H,)          the input head_sink, as given
    float mask          the input attention_bias, given leading axes up to rank 4 and
                        expanded where it broadcasts over T or S: the operator broadcasts
                        over B and H only. No bool mask: the profile sends bool masks as
                        0 / -inf in q's dtype (native.py).

The outputs ``present_key`` and ``present_value`` are always declared, as in every model
with a cache: without them a call with a past gave NaN and wrong rows (measured).

Measured on onnxruntime 1.32.0, CPU, against a float64 NumPy reference (max abs error):
float32 1.8e-7 and float16 6.8e-4 (causal, B2 H4 K2 T=S=5 D8); float64 is refused when the
model is built (its type constraint has no double) and bfloat16 has no CPU kernel
("NOT_IMPLEMENTED: Could not find an implementation"). causal = 0 gives bidirectional
attention (3.5e-7); causal = 1 with a past is bottom-right (1.7e-7 at T3 S7, B1), and
causal = 0 with a past attends every key (1.7e-7). A past with a batch of more than one
and T > 1 is refused ("batch_size must be 1 when sequence_length > 1 and past context is
given"; the optional query_seqlens input lifts that for causal calls only): the adapter
runs such a call one batch entry at a time. T > S and T or S = 0 are refused. GQA (H4 K1, H6 K2) 3e-7;
H % K != 0 refused. head_size must be a multiple of 8 (1, 4, 5, 12 refused; 8 to 512
pass: "head_size must be a multiple of 8. Got head_size % 8 == 4"; tests/test_profiles.py
measures it on the installed version), so where D is not, q, k and v get zero channels
up to the next multiple of 8 and the output's extra channels are dropped: no score
changes (each adds q·k's products and zeros), and the scale is passed as 1/sqrt(D) of the
real D. Without this every test at the suite's head sizes would show that one refusal
and nothing of what the operator computes. Value's hidden size must equal key's (E != D
refused, and left so: `value_dim` is not declared). scale 0.3, 2, -0.5 as
given; scale = 0 is the default 1/sqrt(D). softcap 0.5, 2 as c * tanh(z / c) before the
mask; 0 and negative softcaps are no softcap. local_window_size = W attends keys t' - W + 1
to t' (W = 1: the diagonal, exactly; W = 0: rows of 0). head_sink matches SPEC §15 with
and without causal, with softcap and a window (2.2e-7), in float16 (4.2e-4, sinks in
float16: a float32 head_sink beside float16 inputs is a type error), sinks of 1e4 finite;
a row with every key blocked by -inf returns NaN, or 0 with a sink. attention_bias
(B|1, H|1, T, S) matches; a rank-2 bias, or one whose T axis is 1, is refused.

With ``k_scale`` and ``v_scale`` the cache is int8 (``int8_kv_cache_attention``, the
profile ``onnxruntime.GroupQueryAttention.int8``, SPEC §20): the past keys and values go
in as their int8 codes, the new ones as codes × scale in float32, and the attributes
k_quant_type = v_quant_type = "PER_TENSOR", kv_cache_bit_width = 8 say so. Measured on
onnxruntime 1.32.0, CPU: a float8_e4m3fn cache has no CPU kernel (tests/test_profiles.py).

ONNX letters: batch_size B, sequence_length T, kv_sequence_length (past + new) S,
num_heads H, kv_num_heads K, head_size D (= E).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from conformance.impls import contract

#: The operator's inputs in order; an input not given is an empty name.
INPUTS = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
    "k_scale",
    "v_scale",
)
OUTPUTS = ("output", "present_key", "present_value")
#: Run a step with a past one batch entry at a time (the operator refuses a batch there),
#: and pad head sizes up to a multiple of ``HEAD_MULTIPLE`` (the operator refuses others):
#: tests/test_profiles.py turns both off to measure the refusals on the installed version.
ONE_ENTRY_AT_A_TIME = True
HEAD_MULTIPLE = 8
OPSETS = (("", 21), ("com.microsoft", 1))


def _model(dtypes: tuple[tuple[str, str], ...], attributes: tuple[tuple[str, Any], ...]):
    """One GroupQueryAttention node with the inputs named in ``dtypes``; shapes symbolic."""
    from onnx import helper

    given = dict(dtypes)
    names = [name if name in given else "" for name in INPUTS]
    while not names[-1]:
        names.pop()
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(d)), None)
        for n, d in dtypes
    ]
    element = helper.np_dtype_to_tensor_dtype(np.dtype(given["query"]))
    # The cache comes back in the type it is kept in: the past's, int8 with k_scale.
    kept = given.get("past_key", np.int8 if "k_scale" in given else given["query"])
    cache = helper.np_dtype_to_tensor_dtype(np.dtype(kept))
    outputs = [
        helper.make_tensor_value_info(n, element if n == "output" else cache, None) for n in OUTPUTS
    ]
    node = helper.make_node(
        "GroupQueryAttention", names, list(OUTPUTS), domain="com.microsoft", **dict(attributes)
    )
    graph = helper.make_graph([node], "group_query_attention", inputs, outputs)
    opsets = [helper.make_opsetid(domain, version) for domain, version in OPSETS]
    return helper.make_model(graph, opset_imports=opsets)


@functools.lru_cache(maxsize=256)
def _session(dtypes, attributes):
    import onnxruntime

    model = _model(dtypes, attributes).SerializeToString()
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])


def _pack(x: np.ndarray) -> np.ndarray:
    """(..., T, H, D) -> (..., T, H*D): the operator's hidden size."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1]) if x.ndim >= 2 else x


def _cache(x: np.ndarray) -> np.ndarray:
    """(B, S, K, D) -> (B, K, S, D): the operator's BNSH cache layout."""
    return np.ascontiguousarray(np.swapaxes(x, -3, -2)) if x.ndim >= 3 else x


def _bias(mask: np.ndarray, T: int, S: int) -> np.ndarray:
    """A mask that broadcasts to (B, H, T, S) as the operator takes it: rank 4, T and S whole."""
    if mask.ndim > 4:
        return mask
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    rows = T if mask.shape[2] == 1 else mask.shape[2]
    cols = S if mask.shape[3] == 1 else mask.shape[3]
    return np.ascontiguousarray(np.broadcast_to(mask, (*mask.shape[:2], rows, cols)))


def _window(window: tuple[int | None, int | None] | None, is_causal: bool) -> dict[str, int]:
    """The causal and local_window_size attributes for a spec window (left, right)."""
    if window is None:
        return {}
    left, right = contract.check_window(window)
    if left is None and right is None:
        return {}
    if not (right == 0 or (right is None and is_causal)):
        raise NotImplementedError(
            f"GroupQueryAttention has no right window side (local_window_size is the left "
            f"one, with causal = 1): window={window!r}"
        )
    return {"causal": 1, "local_window_size": -1 if left is None else left + 1}


def group_query_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    attention_bias: np.ndarray | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    scale: float | None = None,
    softcap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    head_sink: np.ndarray | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> np.ndarray:
    """ONNX Runtime's CPU kernel for ``GroupQueryAttention``: the output (B, T, H, E) for
    q (B, T, H, D), k (B, S, K, D), v (B, S, K, E), the first S - T keys as the past.
    With ``k_scale`` and ``v_scale``, k and v are int8 codes with those per-tensor
    descales: the past goes to the operator's int8 cache as the codes, the new keys as
    codes × descale in q's dtype, which the operator quantises with the same scale."""
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment should be 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )
    T = q.shape[-3] if q.ndim >= 3 else 1
    S = k.shape[-3] if k.ndim >= 3 else 1
    if ONE_ENTRY_AT_A_TIME and q.ndim == k.ndim == v.ndim == 4 and q.shape[0] > 1 and 1 < T < S:
        # The operator refuses a past with a batch of more than one and T > 1 ("batch_size
        # must be 1 when sequence_length > 1 and past context is given"): such a step runs
        # one sequence at a time, which is the same attention (no batch entry reads another).
        return np.concatenate(
            [
                group_query_attention(
                    q[b : b + 1],
                    k[b : b + 1] if k.shape[0] > 1 else k,
                    v[b : b + 1] if v.shape[0] > 1 else v,
                    attention_bias=_entry(attention_bias, b),
                    is_causal=is_causal,
                    causal_alignment=causal_alignment,
                    scale=scale,
                    softcap=softcap,
                    window=window,
                    head_sink=head_sink,
                    k_scale=k_scale,
                    v_scale=v_scale,
                )
                for b in range(q.shape[0])
            ]
        )  # (B, T, H, E)
    attributes = {
        "num_heads": q.shape[-2] if q.ndim >= 2 else 1,
        "kv_num_heads": k.shape[-2] if k.ndim >= 2 else 1,
        "causal": int(bool(is_causal)),
    }
    attributes |= _window(window, is_causal)
    if causal_alignment == "top_left" and T != S and (is_causal or window is not None):
        raise NotImplementedError(
            "GroupQueryAttention aligns causal masks bottom-right only (the past keys come "
            f"first): causal_alignment='top_left' with T={T}, S={S}"
        )
    if scale is not None:
        attributes["scale"] = float(scale)
    if softcap is not None:
        attributes["softcap"] = float(softcap)

    q, k, v, D = _whole_bytes(q, k, v)
    if D is not None and scale is None:
        attributes["scale"] = float(1 / np.sqrt(D))

    new = min(T, S)
    batch = q.shape[0] if q.ndim >= 4 else 1
    feeds = {
        "query": _pack(q),
        "key": _pack(_new(k[..., S - new :, :, :] if k.ndim >= 3 else k, k_scale, q.dtype)),
        "value": _pack(_new(v[..., S - new :, :, :] if v.ndim >= 3 else v, v_scale, q.dtype)),
    }
    if k_scale is not None:
        attributes |= {"k_quant_type": "PER_TENSOR", "v_quant_type": "PER_TENSOR"}
        attributes["kv_cache_bit_width"] = 8
    if S > new:
        feeds["past_key"] = _cache(k[..., : S - new, :, :])
        feeds["past_value"] = _cache(v[..., : S - new, :, :])
    feeds["seqlens_k"] = np.full(batch, S - 1, np.int32)
    feeds["total_sequence_length"] = np.array(S, np.int32)
    if attention_bias is not None:
        feeds["attention_bias"] = _bias(np.asarray(attention_bias), T, S)
    if head_sink is not None:
        feeds["head_sink"] = np.asarray(head_sink)
    if k_scale is not None:
        feeds["k_scale"] = np.full(1, k_scale, np.float32)
        feeds["v_scale"] = np.full(1, v_scale, np.float32)

    dtypes = tuple((name, feeds[name].dtype.name) for name in INPUTS if name in feeds)
    session = _session(dtypes, tuple(sorted(attributes.items())))
    out = session.run(["output"], feeds)[0]
    out = out.reshape(*out.shape[:-1], attributes["num_heads"], -1)
    return out if D is None else np.ascontiguousarray(out[..., :D])


def _entry(mask: np.ndarray | None, b: int) -> np.ndarray | None:
    """Batch entry b of a mask broadcasting to (B, H, T, S), still broadcasting."""
    if mask is None or np.ndim(mask) < 4 or np.shape(mask)[0] == 1:
        return mask
    return mask[b : b + 1]


def _whole_bytes(q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """q, k, v with zero channels after their head dim D up to a multiple of 8, and that D,
    where the operator would refuse D (None where it takes the call as it is). Zero
    channels add nothing to any score q·k and give output channels that are dropped, so
    every number the operator computes is the call's; the scale is then 1/sqrt(D) of the
    real D (the operator's default would read the padded one)."""
    if not (q.ndim == k.ndim == v.ndim == 4):
        return q, k, v, None
    D = q.shape[-1]
    if D % HEAD_MULTIPLE == 0 or not (k.shape[-1] == v.shape[-1] == D):
        return q, k, v, None
    extra = [(0, 0)] * 3 + [(0, -D % HEAD_MULTIPLE)]
    return (*(np.pad(x, extra) for x in (q, k, v)), D)


def _new(codes: np.ndarray, descale: float | None, dtype) -> np.ndarray:
    """The new tokens' keys or values as the operator takes them: as given, or int8 codes
    × their per-tensor descale in q's dtype (the operator quantises them itself)."""
    if descale is None:
        return codes
    return (codes.astype(np.float64) * float(descale)).astype(dtype)


def int8_kv_cache_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, q_descale, k_scale, v_scale, **options
) -> np.ndarray:
    """``GroupQueryAttention`` with its int8 KV cache (SPEC §20, the profile
    ``onnxruntime.GroupQueryAttention.int8``): q, k and v int8 codes (B, T|S, H|K, D) with
    per-tensor float32 descales. The operator takes q in float32, so q is handed over as
    codes × q_descale rounded to float32 (one rounding, as every pipeline of §20.6 makes);
    k and v go to its int8 cache with k_scale and v_scale. A KV-cache step: causality and
    windows are bottom-right."""
    q = (np.asarray(q).astype(np.float64) * float(q_descale)).astype(np.float32)
    return group_query_attention(
        q,
        np.asarray(k),
        np.asarray(v),
        causal_alignment="bottom_right",
        k_scale=float(k_scale),
        v_scale=float(v_scale),
        **options,
    )
