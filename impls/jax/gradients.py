"""Gradients of the core page's ``attention`` by ``jax.vjp``: JAX differentiates the very
steps 1-7 that ``attention.compiled`` runs, so this page adds no math of its own.

    L = Σ d_out · attention(q, k, v, ...)        (dq, dk, dv) = ∂L/∂(q, k, v)

A float mask is added to the scores, so it has a gradient too (dmask, summed by JAX's
transpose of the broadcast over the axes the mask was broadcast along); a bool mask only
selects, and has none. The sinks join the softmax and get dsinks; ALiBi's slopes are
constants. A row with no key gets gradient 0, not NaN: step 5's guards select, and a
selection passes the cotangent only to the branch it took (the core page's Notes).

The log-sum-exp's gradient (SPEC §21.7): with ``d_lse``, the forward is the core page's
with ``return_lse``, (out, lse), and JAX pulls (d_out, d_lse) back through both, step 8
included. A row with no key has lse = log 0 = -inf, and log's slope there is 1/0: the
NaN that it makes of exp(-inf)'s cotangent lands on the -inf that step 4 selected for
each score (and the sink logit selects for the sink), a constant, so nothing reaches q, k,
v or the sinks.

Shape legend: the core page's (``attention.py``). Dropout is refused: its gradient would
need the forward's random draw.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from .. import contract
from .attention import as_arrays, compiled


def attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    d_out: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
    d_lse: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Gradients of ``attention`` by ``jax.vjp``.

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes: as for ``attention`` (no dropout).
      d_out: ∂L/∂out, shaped like the output, (B, H, T, E) or (H, T, E), in q's dtype.
      d_lse: ∂L/∂lse for L = Σ d_out · out + Σ d_lse · lse, shaped like the lse, (B, H, T)
        or (H, T), in its dtype (float64 for float64 q, else float32); None: 0.

    Returns:
      (dq, dk, dv) shaped like q, k, v; with a floating mask, (dq, dk, dv, dmask), dmask
      shaped like the mask; with sinks, dsinks (H,) last.
    """
    # 0. Validate as the forward does (eagerly, so errors are ours, not a tracer's), and
    # d_out against the output's shape.
    q, k, v, d_out, mask, sinks, alibi_slopes, d_lse = as_arrays(
        q, k, v, d_out, mask, sinks, alibi_slopes, d_lse
    )
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes, d_out=d_out, d_lse=d_lse,
        unsupported={"dropout_p": "the backward pass would need the forward's random draw"},
    )  # fmt: skip
    static = dataclasses.replace(call, scale=None)  # the scale traced, as in the forward
    return pullback(q, k, v, mask, sinks, alibi_slopes, d_out, d_lse, call.scale, call=static)


@functools.partial(jax.jit, static_argnames=("call",))
def pullback(q, k, v, mask, sinks, alibi_slopes, d_out, d_lse, scale, *, call: contract.Checked):
    """jax.vjp of steps 1-7 (and 8, with d_lse), compiled once per shape and options (and
    d_lse given or not): the gradients of q, k, v, then of a float mask, then of the sinks,
    where given."""
    float_mask = mask is not None and not call.mask_is_bool
    primals = [q, k, v] + [mask] * float_mask + [sinks] * (sinks is not None)

    def forward(q, k, v, *rest):
        rest = list(rest)
        given_sinks = rest.pop() if sinks is not None else None
        given_mask = rest.pop() if float_mask else mask
        return compiled(
            q, k, v, given_mask, given_sinks, alibi_slopes, None, scale, call=call,
            return_lse=d_lse is not None,
        )  # fmt: skip

    _, pull = jax.vjp(forward, *primals)
    return pull(d_out if d_lse is None else (d_out, d_lse))
