"""The oracle itself: checked against closed forms and an independent float64 computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conformance.fixtures import oracle


@pytest.mark.clause("11.1")
def test_worked_example_closed_form():
    """Causal row 1 of the seeds' example: keys 0 and 1, scores 0 and 1/√2."""
    q = np.array([[[[1.0, 0], [0, 1], [1, 1]]]])
    k = np.array([[[[1.0, 0], [0, 1], [1, 0]]]])
    v = np.array([[[[1.0, 2], [3, 4], [5, 6]]]])
    out = oracle.attention(q, k, v, is_causal=True)[0, 0]
    a = math.exp(1 / math.sqrt(2))
    row1 = (1 * 1 + a * 3) / (1 + a)
    assert abs(out[1, 0] - row1) < 1e-15 and abs(out[1, 1] - (row1 + 1)) < 1e-15
    assert out[0].tolist() == [1.0, 2.0]
    # Row 2 sees keys 0 and 2 with equal scores, and key 1 in between: the mean is (3, 4).
    assert np.allclose(out[2], [3.0, 4.0], atol=1e-15)


@pytest.mark.clause("7.2")
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"softcap": 2.0, "window": (2, 1)},
        {"is_causal": True, "causal_alignment": "bottom_right"},
    ],
)
def test_oracle_agrees_with_float64_naive(options):
    """Two independent computations, 50-digit loops and float64 arrays, agree to ~1e-15."""
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((2, 4, 5, 3)),
        rng.standard_normal((2, 2, 7, 3)),
        rng.standard_normal((2, 2, 7, 4)),
    )
    exact = oracle.attention(q, k, v, **options)
    naive = oracle.naive_same_precision(q, k, v, np.float64, **options)
    assert np.max(np.abs(exact - naive)) < 1e-14


@pytest.mark.clause("7.2")
def test_naive_run_has_the_dtype_error():
    """The naive float32 run is off by float32 rounding, not more and not less."""
    rng = np.random.default_rng(1)
    q, k, v = (
        rng.standard_normal((1, 2, 9, 8)),
        rng.standard_normal((1, 2, 9, 8)),
        rng.standard_normal((1, 2, 9, 8)),
    )
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in (q, k, v))
    err = np.max(
        np.abs(oracle.naive_same_precision(q, k, v, np.float32) - oracle.attention(q, k, v))
    )
    assert 2**-26 < err < 2**-18


@pytest.mark.clause("4.3")
def test_oracle_fully_masked_row_is_zero():
    q, k, v = np.ones((1, 1, 2, 2)), np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2))
    mask = np.array([[True, False, True], [False, False, False]])
    out = oracle.attention(q, k, v, mask=mask)
    assert out[0, 0, 1].tolist() == [0.0, 0.0] and out[0, 0, 0].tolist() == [1.0, 1.0]


# --- Attention sinks (SPEC §15) -------------------------------------------------------------


def _sink_example() -> dict:
    from conformance.fixtures import generate

    return generate.WORKED_EXAMPLE["sinks"]


@pytest.mark.clause("15.1")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_sinks_worked_example_by_hand(causal):
    """The hand computation in fixtures/worked_example.json: scores and sink all 0, so
    every attended key and the sink weigh alike (its description does the arithmetic)."""
    ex = _sink_example()
    q, k, v, d_out = (
        np.array(ex[n], dtype=np.float64)[None, None] for n in ("q", "k", "v", "d_out")
    )
    sinks = np.array(ex["sinks"])
    key = "causal" if causal else "non_causal"
    out = oracle.attention(q, k, v, is_causal=causal, sinks=sinks)[0, 0]
    assert np.max(np.abs(out - np.array(ex[key]["hand"]))) < 1e-15
    grads = oracle.attention_vjp(q, k, v, d_out, is_causal=causal, sinks=sinks)
    assert abs(grads["dsinks"][0] - ex[key]["dsinks_hand"][0]) < 1e-14
    without = oracle.attention(q, k, v, is_causal=True, sinks=np.array([-np.inf]))[0, 0]
    assert without.tolist() == ex["no_sink_causal"]["hand"]


def _sinks_inputs(seed: int = 3):
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((2, 4, 5, 3)),
        rng.standard_normal((2, 2, 7, 3)),
        rng.standard_normal((2, 2, 7, 4)),
    )
    return q, k, v, rng.standard_normal(4)


@pytest.mark.clause("15.1")
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"softcap": 2.0, "window": (2, 1)},
        {"is_causal": True, "causal_alignment": "bottom_right"},
    ],
)
def test_sinks_oracle_is_transformers_eager_path(options):
    """transformers' eager path, in float64 arrays: concatenate the sink as one more column
    of the masked scores, take the softmax, drop the column, multiply by V."""
    q, k, v, sinks = _sinks_inputs()
    exact = oracle.attention(q, k, v, sinks=sinks, **options)
    scores = np.where(
        oracle._naive_forward(
            q,
            k,
            v,
            np.dtype(np.float64),
            None,
            options.get("is_causal", False),
            None,
            options.get("causal_alignment", "top_left"),
            options.get("window"),
            options.get("softcap"),
        ).weights
        > 0,
        0.0,
        -np.inf,
    )  # which keys each row attends, from the naive run's weights
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    raw = q @ np.swapaxes(kk, -1, -2) / np.sqrt(3)
    if options.get("softcap"):
        raw = options["softcap"] * np.tanh(raw / options["softcap"])
    columns = np.concatenate(
        [raw + scores, np.broadcast_to(sinks[None, :, None, None], (2, 4, 5, 1))], axis=-1
    )
    p = np.exp(columns - columns.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    eager = p[..., :-1] @ vv
    assert np.max(np.abs(exact - eager)) < 1e-14
    naive = oracle.naive_same_precision(q, k, v, np.float64, sinks=sinks, **options)
    assert np.max(np.abs(exact - naive)) < 1e-14


@pytest.mark.clause("15.3", "15.4")
def test_sinks_oracle_edges():
    """A -inf sink is no sink; a row with no key is 0 whatever its sink holds; a NaN or +inf
    sink makes the rows with a key NaN."""
    q, k, v, _ = _sinks_inputs(4)
    mask = np.ones((5, 7), dtype=bool)
    mask[2] = False
    plain = oracle.attention(q, k, v, mask=mask)
    sinks = np.array([-np.inf, np.nan, np.inf, -np.inf])
    out = oracle.attention(q, k, v, mask=mask, sinks=sinks)
    assert np.array_equal(out[:, [0, 3]], plain[:, [0, 3]])
    assert (out[:, :, 2] == 0).all()
    rows = [0, 1, 3, 4]
    assert np.isnan(out[:, 1:3][:, :, rows]).all()
    naive = oracle.naive_same_precision(q, k, v, np.float64, mask=mask, sinks=sinks)
    assert np.array_equal(np.isnan(naive), np.isnan(out))


# --- Chunked local attention (SPEC §16) and ALiBi (SPEC §17) ---------------------------------


@pytest.mark.clause("16.1")
@pytest.mark.parametrize("key", ["non_causal", "causal", "bottom_right_last_two"])
def test_chunked_worked_example_by_hand(key):
    """The hand computation in fixtures/worked_example.json ("chunked"): every score 0, so
    each row averages the values of its chunk that it may see."""
    from conformance.fixtures import generate

    ex = generate.WORKED_EXAMPLE["chunked"]
    q, k, v = (np.array(ex[n], dtype=np.float64)[None, None] for n in "qkv")
    options = {"is_causal": key != "non_causal", "chunk_size": ex["chunk_size"]}
    if key == "bottom_right_last_two":
        q, options["causal_alignment"] = q[:, :, 2:], "bottom_right"
    out = oracle.attention(q, k, v, **options)[0, 0]
    assert out.tolist() == ex[key]["hand"]


@pytest.mark.clause("16.1", "16.2")
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("T, S", [(5, 11), (11, 5), (8, 8)])
def test_chunks_are_a_mask_in_the_oracle(alignment, T, S):
    """chunk_size is the bool mask pos(t) // c == s // c (pos(t) = t, or t + S - T), ANDed
    with causality: in the oracle and in the naive run."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, n, 3)) for n in (T, S, S))
    position = np.arange(T)[:, None] + (0 if alignment == "top_left" else S - T)
    mask = position // 3 == np.arange(S)[None, :] // 3  # (T, S)
    options = {"is_causal": True, "causal_alignment": alignment}
    chunked = oracle.attention(q, k, v, chunk_size=3, **options)
    masked = oracle.attention(q, k, v, mask=mask, **options)
    assert np.array_equal(chunked, masked)
    naive = oracle.naive_same_precision(q, k, v, np.float64, chunk_size=3, **options)
    assert np.max(np.abs(naive - chunked)) < 1e-14


@pytest.mark.clause("17.1")
@pytest.mark.parametrize("key", ["non_causal", "causal", "one_query_top_left"])
def test_alibi_worked_example_by_hand(key):
    """The hand computation in fixtures/worked_example.json ("alibi"): every score 0 and
    the slope ln 2, so each key weighs 2^(-distance)."""
    from conformance.fixtures import generate

    ex = generate.WORKED_EXAMPLE["alibi"]
    q, k, v = (np.array(ex[n], dtype=np.float64)[None, None] for n in "qkv")
    if key == "one_query_top_left":
        q = q[:, :, 1:]
    slopes = np.array(ex["alibi_slopes"])
    out = oracle.attention(q, k, v, is_causal=key == "causal", alibi_slopes=slopes)[0, 0]
    assert np.max(np.abs(out - np.array(ex[key]["hand"]))) < 1e-14


@pytest.mark.clause("17.1")
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("T, S", [(5, 11), (11, 5)])
def test_alibi_is_a_float_mask_in_the_oracle(alignment, T, S):
    """ALiBi's slopes (H,) and (B, H) are the float mask −slope · |t + S − T − s| in either
    alignment (FlashAttention's attn_bias): in the oracle and in the naive run."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 3, n, 4)) for n in (T, S, S))
    distance = np.abs(np.arange(T)[:, None] + S - T - np.arange(S)[None, :])  # (T, S)
    options = {"is_causal": True, "causal_alignment": alignment}
    for slopes in (rng.uniform(0, 1, 3), rng.uniform(0, 1, (2, 3))):
        bias = -slopes.reshape(-1, 3, 1, 1) * distance  # (B|1, H, T, S)
        alibi = oracle.attention(q, k, v, alibi_slopes=slopes, **options)
        masked = oracle.attention(q, k, v, mask=bias, **options)
        assert np.max(np.abs(alibi - masked)) < 1e-15
        naive = oracle.naive_same_precision(q, k, v, np.float64, alibi_slopes=slopes, **options)
        assert np.max(np.abs(naive - alibi)) < 1e-14


# --- Packed variable-length sequences (SPEC §18) ---------------------------------------------


@pytest.mark.clause("18.1")
@pytest.mark.parametrize(
    "key", ["non_causal", "causal", "unequal_top_left", "unequal_bottom_right"]
)
def test_packed_worked_example_by_hand(key):
    """The hand computation in fixtures/worked_example.json ("packed"): every score 0, so
    each row averages the values of its own document that it may see."""
    from conformance.fixtures import generate

    ex = generate.WORKED_EXAMPLE["packed"]
    q, k, v = (np.array(ex[n], dtype=np.float64)[None] for n in "qkv")
    cu_q = cu_k = np.array(ex["cu_seqlens"])
    options = {"is_causal": key != "non_causal"}
    if key.startswith("unequal"):
        cu_q, cu_k = (np.array(ex["unequal"][n]) for n in ("cu_seqlens_q", "cu_seqlens_k"))
        q = q[:, :2]
        options["causal_alignment"] = key.removeprefix("unequal_")
    out = oracle.attention_packed(q, k, v, cu_q, cu_k, **options)[0]
    assert out.tolist() == ex[key]["hand"]


def _document_mask(cu_q, cu_k, alignment, window=None):
    """The packed documents as one dense bool mask (T, S), written out by hand from SPEC
    §18.1-§18.2: same document, and causal (with the window) within it."""
    T, S = cu_q[-1], cu_k[-1]
    mask = np.zeros((T, S), dtype=bool)
    for n in range(len(cu_q) - 1):
        Tn, Sn = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        i = np.arange(Tn)[:, None] + (0 if alignment == "top_left" else Sn - Tn)
        j = np.arange(Sn)[None, :]
        allowed = j <= i
        if window is not None:
            allowed &= j >= i - window
        mask[cu_q[n] : cu_q[n + 1], cu_k[n] : cu_k[n + 1]] = allowed
    return mask


@pytest.mark.clause("18.1", "18.2")
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, 1])
def test_packed_is_the_document_mask_in_the_oracle(alignment, window):
    """Slicing documents (the packed oracle) gives the whole sequence under the documents'
    block-diagonal causal mask, built by hand: an empty document, one with no key, and
    unequal T_n, S_n; in the oracle and in the naive run."""
    rng = np.random.default_rng(7)
    cu_q, cu_k = [0, 3, 3, 5, 9], [0, 4, 4, 4, 11]
    q, k, v = (rng.standard_normal((2, n, 3)) for n in (9, 11, 11))
    options = {"is_causal": True, "causal_alignment": alignment}
    if window is not None:
        options["window"] = (window, None)
    packed = oracle.attention_packed(q, k, v, np.array(cu_q), np.array(cu_k), **options)
    mask = _document_mask(cu_q, cu_k, alignment, window)
    masked = oracle.attention(q[None], k[None], v[None], mask=mask)[0]
    assert np.array_equal(packed, masked)
    assert (packed[:, 3:5] == 0).all()  # the document with no key
    naive = oracle.naive_packed_same_precision(
        q, k, v, np.array(cu_q), np.array(cu_k), np.float64, **options
    )
    assert np.max(np.abs(naive - packed)) < 1e-14


# --- Paged KV caches (SPEC §19) --------------------------------------------------------------


@pytest.mark.clause("19.1")
@pytest.mark.parametrize("key", ["decode", "causal_last_two"])
def test_paged_worked_example_by_hand(key):
    """The hand computation in fixtures/worked_example.json ("paged"): every score 0, so a
    row is the mean of the values it sees, read from page 1 then page 0 by the table."""
    from conformance.fixtures import generate

    ex = generate.WORKED_EXAMPLE["paged"]
    q = np.array(ex["q"], dtype=np.float64)[None, None]
    k_pages, v_pages = (np.array(ex[n], dtype=np.float64) for n in ("k_pages", "v_pages"))
    table, lens = np.array(ex["block_table"]), np.array(ex["seq_lens"])
    rows = q[:, :, 1:] if key == "decode" else q
    out = oracle.attention_paged(
        rows, k_pages, v_pages, table, lens, is_causal=key == "causal_last_two"
    )
    assert out[0, 0].tolist() == ex[key]["hand"]


def _paginate(rng, k, v, L: int, N: int, lens):
    """Dense per-sequence keys k (B, K, S, D), v (B, K, S, E) written into N shuffled pages
    of L slots, NaN everywhere else: (k_pages, v_pages, block_table), tails -1."""
    B, K, S, D = k.shape
    E = v.shape[-1]
    M = -(-S // L)
    k_pages = np.full((N, K, L, D), np.nan)
    v_pages = np.full((N, K, L, E), np.nan)
    free = list(rng.permutation(N))
    table = np.full((B, M), -1)
    for b in range(B):
        for j in range(-(-lens[b] // L)):
            page = free.pop()
            table[b, j] = page
            for i in range(L):
                s = j * L + i
                if s < lens[b]:
                    k_pages[page, :, i] = k[b, :, s]
                    v_pages[page, :, i] = v[b, :, s]
    return k_pages, v_pages, table


@pytest.mark.clause("19.1", "19.2")
@pytest.mark.parametrize(
    "options",
    [{}, {"is_causal": True}, {"window": (1, 0), "softcap": 2.0}],
    ids=["plain", "causal", "window-softcap"],
)
def test_paged_oracle_is_attention_on_each_sequence(options):
    """Written into shuffled pages by a different route (slot by slot, NaN elsewhere, -1
    table tails), the paged oracle gives, for each sequence, the oracle's bottom-right
    attention on its first seq_lens[b] dense keys; and the naive run the same rows."""
    rng = np.random.default_rng(7)
    B, H, K, T, S, D, E, L = 3, 2, 1, 2, 7, 3, 2, 3
    lens = [7, 2, 5]
    q = rng.standard_normal((B, H, T, D))
    k, v = rng.standard_normal((B, K, S, D)), rng.standard_normal((B, K, S, E))
    k_pages, v_pages, table = _paginate(rng, k, v, L, 9, lens)
    out = oracle.attention_paged(q, k_pages, v_pages, table, np.array(lens), **options)
    for b, n in enumerate(lens):
        want = oracle.attention(
            q[b : b + 1],
            k[b : b + 1, :, :n],
            v[b : b + 1, :, :n],
            causal_alignment="bottom_right",
            **options,
        )
        assert np.array_equal(out[b : b + 1], want)
    naive = oracle.attention_paged(
        q, k_pages, v_pages, table, np.array(lens), naive_dtype=np.float64, **options
    )
    assert np.max(np.abs(naive - out)) < 1e-14


@pytest.mark.clause("19.4", "12.11")
def test_paged_oracle_gradients_match_finite_differences():
    """The paged gradient oracle (dq and the pages' gradients, a shared page summing two
    sequences' contributions, unread slots 0) against central differences of the paged
    forward oracle, as tests/test_gradients_oracle.py checks the dense one."""
    rng = np.random.default_rng(8)
    B, H, K, T, D, E, N, L = 2, 2, 1, 2, 2, 2, 4, 2
    q = rng.standard_normal((B, H, T, D))
    k_pages, v_pages = rng.standard_normal((N, K, L, D)), rng.standard_normal((N, K, L, E))
    table = np.array([[2, 0, -1], [2, 3, 7]])  # page 2 shared; page 1 read by none
    lens = np.array([3, 4])
    d_out = rng.standard_normal((B, H, T, E))
    options = {"is_causal": True, "softcap": 1.5}
    grads = oracle.attention_paged_vjp(q, k_pages, v_pages, table, lens, d_out, **options)

    def loss(q, k_pages, v_pages):
        out = oracle.attention_paged(q, k_pages, v_pages, table, lens, **options)
        return float(np.sum(out * d_out))

    step = 1e-5
    for which, name in enumerate(("dq", "dk_pages", "dv_pages")):
        arrays = [q, k_pages, v_pages]
        x = arrays[which]
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
            plus[which][idx] += step
            minus[which][idx] -= step
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * step)
        assert np.max(np.abs(grads[name] - fd)) < 1e-8, name
    assert (grads["dk_pages"][1] == 0).all() and (grads["dv_pages"][1] == 0).all()
    assert (grads["dk_pages"][0, :, 1] == 0).all()  # slot 1 of page 0: past sequence 0's end
