"""Quantized attention with a misreading planted (SPEC §20), for
``conformance/suite/misreadings_quantized.py``: the declared P pipeline
(``conformance.fixtures.quantized.pipeline``) on a departing call's misread codes or
descales (``QuantizedCall``, ``quantized_run``), and the pipeline with one of its steps
misread (``p_pipeline_misread``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from conformance.suite.planted import Call, allowed

# --- Quantized attention (SPEC §20) ---------------------------------------------------------


class QuantizedCall(NamedTuple):
    """A departing ``attention_quantized`` call: codes, descales (``operands``), options,
    the declared P pipeline, and the output returned."""

    operands: dict
    options: dict
    pipeline: str
    actual: np.ndarray | None = None

    def descale(self, role: str) -> np.ndarray:
        return np.asarray(self.operands[f"{role}_descale"], dtype=np.float64)

    def shape(self) -> tuple[int, int, int]:
        B, H = np.shape(self.operands["q"])[:2]
        return B, H, np.shape(self.operands["k"])[1]

    def format(self, role: str) -> str:
        return np.asarray(self.operands[role]).dtype.name


def quantized_run(call: QuantizedCall, pipeline: str | None = None, options=None, **changes):
    """The declared pipeline (or ``pipeline``) on the call's operands with ``changes`` (a
    code array or descale replaced) and ``options`` changed."""
    from conformance.fixtures import quantized as fq

    o = {**call.operands, **changes}
    with np.errstate(all="ignore"):
        return fq.pipeline(
            o["q"], o["k"], o["v"], o["q_descale"], o["k_descale"], o["v_descale"],
            pipeline or call.pipeline, block_size=o.get("block_size"),
            **{**call.options, **(options or {})},
        )  # fmt: skip


def descales_dropped(roles: str) -> Callable[[QuantizedCall], np.ndarray]:
    return lambda c: quantized_run(
        c, **{f"{r}_descale": np.ones_like(c.descale(r), np.float32) for r in roles}
    )


def descale_twice(role: str) -> Callable[[QuantizedCall], np.ndarray]:
    return lambda c: quantized_run(
        c, **{f"{role}_descale": (c.descale(role) ** 2).astype(np.float32)}
    )


def descale_by_query_head(c: QuantizedCall) -> np.ndarray:
    """Query head h reads q_descale[b, h % K], not q_descale[b, h // G]: a (B, H) descale."""
    B, H, K = c.shape()
    return quantized_run(c, q_descale=c.descale("q")[:, np.arange(H) % K].astype(np.float32))


def first_descale_for_all(c: QuantizedCall) -> np.ndarray:
    changes = {}
    for r in "qkv":
        d = c.descale(r)
        if d.ndim >= 2 and d.size > 1:
            changes[f"{r}_descale"] = np.full_like(d, d.flat[0], dtype=np.float32)
    return quantized_run(c, **changes)


def v_descale_before_softmax(c: QuantizedCall) -> np.ndarray:
    """v's descale multiplies the scores with q's and k's, and not the output."""
    dq, dv = c.descale("q"), c.descale("v")
    both = np.broadcast_to(dq * dv, np.broadcast_shapes(dq.shape, dv.shape))
    return quantized_run(
        c, q_descale=both.astype(np.float32), v_descale=np.ones_like(dv, np.float32)
    )


def q_and_v_descales_swapped(c: QuantizedCall) -> np.ndarray | None:
    dq, dv = c.descale("q"), c.descale("v")
    if dq.shape != dv.shape or np.array_equal(dq, dv):
        return None
    return quantized_run(c, q_descale=dv.astype(np.float32), v_descale=dq.astype(np.float32))


def _is_batch_by_head(c: QuantizedCall, role: str) -> bool:
    B, _, K = c.shape()
    return c.descale(role).shape == (B, K) and B > 1 and K > 1


def descales_transposed(c: QuantizedCall) -> np.ndarray | None:
    """Each (B, K) descale read as a (K, B) array: element [b, κ] taken from the memory
    offset κ·B + b, where b·K + κ holds it."""
    B, _, K = c.shape()
    changes = {
        f"{r}_descale": c.descale(r).reshape(-1).reshape(K, B).T.astype(np.float32)
        for r in "qkv"
        if _is_batch_by_head(c, r)
    }
    return quantized_run(c, **changes) if changes else None


def quantized_scale_twice(c: QuantizedCall) -> np.ndarray:
    D = np.shape(c.operands["q"])[-1]
    scale = c.options.get("scale")
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    return quantized_run(c, options={"scale": scale * scale})


def v_codes_as(fmt: str, *, reinterpret: bool) -> Callable[[QuantizedCall], np.ndarray | None]:
    """v's float8_e4m3fn codes as ``fmt``: their bytes read as that format
    (``reinterpret``), or their values rounded to it."""
    import ml_dtypes

    def compute(c: QuantizedCall) -> np.ndarray | None:
        codes = np.asarray(c.operands["v"])
        if codes.dtype.name != "float8_e4m3fn":
            return None
        target = np.dtype(getattr(ml_dtypes, fmt))
        misread = codes.view(target) if reinterpret else codes.astype(np.float32).astype(target)
        return quantized_run(c, v=misread)

    return compute


def v_offset_per_head(c: QuantizedCall) -> np.ndarray | None:
    """An int8 v whose zero point is dropped: every value of a (batch, key/value head) off
    by one constant, so every output row of its query heads is off by that constant. The
    constant is read off the output returned (the median of its offset)."""
    if c.format("v") != "int8" or c.actual is None or c.descale("v").ndim > 2:
        return None
    right = quantized_run(c)
    if c.actual.shape != right.shape:
        return None
    with np.errstate(invalid="ignore"):
        offset = np.nanmedian(c.actual - right, axis=(2, 3), keepdims=True)  # (B, H, 1, 1)
    offset = np.where(np.isfinite(offset), offset, 0.0)
    live = np.any(right != 0, axis=-1, keepdims=True)  # rows with no key stay 0
    return np.where(live, right + offset, right)


def p_pipeline_misread(
    p_format: str = "float8_e4m3fn",
    accumulate: str = "float32",
    tile: int | None = None,
    stale: bool = False,
    cast_rule: str = "overflow",
) -> Callable[[QuantizedCall], np.ndarray | None]:
    """The declared P pipeline, over key tiles of ``tile`` (None: one tile) with a running
    maximum, with one step misread: P rounded to ``p_format``; P·V accumulated key by key
    in ``accumulate``; or (``stale``) P taken at the row maximum of the tiles before (the
    running maximum not updated before P is rounded), so a growing score lifts P · 2⁸ past
    448 (NaN with the overflow ``cast_rule``, 448 with saturate)."""
    stale_tile = tile if stale else None
    import ml_dtypes

    def compute(c: QuantizedCall) -> np.ndarray | None:
        from conformance.fixtures import quantized as fq

        if c.pipeline == "float32" or "sinks" in c.options or "softcap" in c.options:
            return None
        if c.options.get("mask") is not None and np.asarray(c.options["mask"]).dtype != bool:
            return None
        unnormalized = c.pipeline == "e4m3_unnormalized"
        f32 = np.float32
        o = c.operands
        L = o.get("block_size")
        q = fq.dequantize(o["q"], o["q_descale"]).astype(f32)
        k = fq.dequantize(o["k"], o["k_descale"], L).astype(f32)
        # A per-head v descale is applied at the end, as kernels do: P·V is summed over
        # the codes, whose rounding in a narrow accumulator differs from the values'.
        late = np.ndim(o["v_descale"]) <= 2
        v_scale = fq.dequantize(np.ones_like(np.asarray(o["v"], np.float32)[..., :1]),
                                o["v_descale"], L).astype(f32) if late else f32(1)  # fmt: skip
        v = (
            np.asarray(o["v"]).astype(f32)
            if late
            else fq.dequantize(o["v"], o["v_descale"], L).astype(f32)
        )
        call = Call(q.astype(np.float64), k.astype(np.float64), k[..., :1].astype(np.float64),
                    c.options.get("mask"), {"causal_alignment": "top_left", **{
                        n: x for n, x in c.options.items() if n != "mask"}})  # fmt: skip
        ok = allowed(call)  # (B, H, T, S)
        k, v = (np.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
        scale = f32(call.scale)
        with np.errstate(all="ignore"):
            s = np.where(ok, np.matmul(q, np.swapaxes(k, -1, -2)) * scale, -np.inf).astype(f32)
            width = tile or s.shape[-1] or 1
            if tile is not None and not unnormalized:
                return None
            lift = f32(fq.P_OFFSET if unnormalized else 1.0)
            m = np.full((*s.shape[:-1], 1), -np.inf, f32)  # (B, H, T, 1)
            total = np.zeros_like(m)
            acc = np.zeros((*s.shape[:-1], v.shape[-1]), f32)  # (B, H, T, E)
            top = s.max(axis=-1, keepdims=True, initial=-np.inf)
            for s0 in range(0, s.shape[-1], width):
                x = s[..., s0 : s0 + width]
                m_new = np.maximum(m, x.max(axis=-1, keepdims=True)) if tile else top
                at = np.where(np.isfinite(m), m, m_new) if stale_tile else m_new
                at = np.where(np.isfinite(at), at, f32(0))
                alpha = np.where(np.isfinite(m), np.exp(m - at), f32(0)).astype(f32)
                p = np.exp(x - at).astype(f32)
                total = total * alpha + p.sum(axis=-1, keepdims=True, dtype=f32)
                lifted = p * lift if unnormalized else p
                if not unnormalized:
                    row = np.exp(s - at).sum(axis=-1, keepdims=True, dtype=f32)
                    lifted = p / np.where(row > 0, row, f32(1))
                if cast_rule == "saturate":
                    lifted = np.minimum(lifted, f32(fq.LARGEST[p_format]))
                p8 = lifted.astype(np.dtype(getattr(ml_dtypes, p_format))).astype(f32)
                pv = _accumulated(p8, v[..., s0 : s0 + width, :], accumulate)
                acc = (acc * alpha + pv).astype(f32)
                m = at
            if unnormalized:
                out = acc / lift / np.where(total > 0, total, f32(1))
            else:
                out = acc
            if late:  # v_scale (B, K, S, 1): one descale a head, over its query heads
                out = out * np.repeat(v_scale[:, :, :1], q.shape[1] // v_scale.shape[1], axis=1)
            live = ok.any(axis=-1)[..., None]
            return np.where(live, out, 0.0).astype(np.float64)

    return compute


def _accumulated(p, v, dtype: str) -> np.ndarray:
    """p @ v in float32, or summed key by key in ``dtype`` (each partial sum rounded)."""
    if dtype == "float32":
        return np.matmul(p, v)
    import ml_dtypes

    low = np.dtype(getattr(ml_dtypes, dtype))
    acc = np.zeros((*p.shape[:-1], v.shape[-1]), np.float32)  # (B, H, T, E)
    for s in range(p.shape[-1]):
        term = p[..., s, None] * v[..., s, None, :]  # (B, H, T, E)
        acc = (acc + term).astype(low).astype(np.float32)
    return acc
