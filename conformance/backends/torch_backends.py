"""The PyTorch backends: the naive impl, the nn.Module, SDPA, and the context-parallel
ring and Ulysses backends on a pool of worker processes."""

from __future__ import annotations

import functools
import importlib
from types import MappingProxyType

import numpy as np

from conformance.backends.arrays import TorchFramework
from conformance.backends.base import Backend
from conformance.backends.numpy_backends import QUANTIZED_CAPABILITIES, quantized_form
from conformance.vocabulary import ALL_CAPABILITIES, DTYPES, GRAD_CAPABILITIES


class _TorchBackend(Backend):
    framework = "torch"
    dtypes = DTYPES

    def __init__(self) -> None:
        # The one converter between NumPy and torch, shared with the profiles' calls.
        self.arrays = TorchFramework()
        self.torch = self.arrays.torch

    def from_numpy(self, x):
        return self.arrays.from_numpy(x)

    def to_numpy(self, x):
        return self.arrays.to_numpy(x)

    def versions(self):
        return {**super().versions(), "torch": self.torch.__version__}

    def _attention_vjp(self, q, k, v, d_out, *, mask=None, **options):
        # Autograd through the very forward the suite tests (the framework's one vjp): q,
        # k, v (and a float mask) become leaves, and the output's vector-Jacobian product
        # with d_out is read off them.
        primals = [q, k, v]
        float_mask = mask is not None and mask.dtype.is_floating_point
        if float_mask:
            primals.append(mask)
        # Sinks (SPEC §15.5) are differentiated too, their gradient last.
        sinks = options.pop("sinks", None)
        if sinks is not None:
            primals.append(sinks)
        # The lse's cotangent (SPEC §21.7): the forward returns (out, lse) and autograd
        # takes (d_out, d_lse) back through both.
        d_lse = options.pop("d_lse", None)
        if d_lse is not None:
            options["return_lse"] = True
            d_out = (d_out, d_lse)

        def call(q, k, v, *rest):
            rest = list(rest)
            extra = {"sinks": rest.pop()} if sinks is not None else {}
            given = rest.pop() if float_mask else mask
            return self._attention(q, k, v, mask=given, **extra, **options)

        check = _check_d_out if d_lse is None else _check_d_out_and_d_lse
        return self.arrays.vjp(call, primals, d_out, check=check)

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        return self.packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        # Autograd through the packed forward; the boundaries are integers, not leaves.
        def call(q, k, v):
            return self._attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

        return self.arrays.vjp(call, [q, k, v], d_out, check=_check_d_out)

    def _attention_paged(self, q, k_pages, v_pages, block_table, seq_lens, **options):
        return self.paged(q, k_pages, v_pages, block_table, seq_lens, **options)

    def _attention_paged_vjp(self, q, k_pages, v_pages, block_table, seq_lens, d_out, **options):
        # Autograd through the paged forward: q and the pages are the leaves (the table
        # and the lengths are integers, with no gradient); the gather's backward adds each
        # read slot's gradient into its page, so a shared page sums its readers (SPEC §19.4).
        def call(q, k_pages, v_pages):
            return self._attention_paged(q, k_pages, v_pages, block_table, seq_lens, **options)

        return self.arrays.vjp(call, [q, k_pages, v_pages], d_out, check=_check_d_out)


def _pages(name: str):
    """A page of the impls/torch package, imported when a backend is made (never at import)."""
    return importlib.import_module(f"conformance.impls.torch.{name}")


def _check_d_out(out, d_out) -> None:
    """d_out must be shaped and typed like the output, said in the spec's words."""
    if d_out.shape != out.shape:
        letters = "(B, H, T, E)" if out.ndim == 4 else "(H, T, E)"
        raise ValueError(
            f"d_out shape should be the output's {letters} = {tuple(out.shape)}, "
            f"got {tuple(d_out.shape)}"
        )
    if d_out.dtype != out.dtype:
        raise TypeError(f"d_out dtype should be {out.dtype} like q, got {d_out.dtype}")


class TorchRingBackend(_TorchBackend):
    """Ring attention on a pool of P torch.distributed (gloo) worker processes.

    ``load_backend("torch-ring", shards=P, layout=...)`` (``world_size=P`` is the same);
    left out, P = 4 and the zigzag layout. The pool starts on first use, is reused, and
    stops at exit; a dead worker raises ``WorkerDied`` and the next call starts a new one.
    The backward pass is a second ring, written by hand (autograd does not differentiate
    point-to-point communication). A packed call (SPEC §18) is one sequence of tokens split
    over the ranks in the same way, each token carrying its document round the ring.
    """

    name = "torch-ring"
    capabilities = (
        (ALL_CAPABILITIES - {"dropout", "module"})
        | (GRAD_CAPABILITIES - {"module_grad"})
        | {"sharded", "sinks", "chunked", "alibi", "packed", "lse"}
    )
    conformance_options = MappingProxyType({"shards": 3, "layout": "zigzag"})
    default_shards = 4
    impl_module = "conformance.impls.torch.ring"

    def __init__(
        self, *, shards: int | None = None, world_size: int | None = None, layout: str = "zigzag"
    ) -> None:
        super().__init__()
        #: The worker pools, shared with torch-ulysses, which runs its ranks on them too.
        self.pool = _pages("process_pool")
        self.impl = importlib.import_module(self.impl_module)
        layouts = _pages("ring_layout").LAYOUTS
        P = shards if shards is not None else world_size
        P = self.default_shards if P is None else P
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"shards should be a positive int (P processes), got {P!r}")
        if layout not in layouts:
            raise ValueError(f"layout should be one of {layouts}, got {layout!r}")
        self.shards, self.layout = P, layout
        self.options = {"shards": P, "layout": layout}

    def from_numpy(self, x):
        return np.asarray(x)  # the impl lays the arrays out and hands them to its ranks

    def to_numpy(self, x):
        return np.asarray(x)

    def _attention(self, q, k, v, *, seed=None, **options):
        # No dropout: the impl refuses dropout_p > 0 by name, so the seed goes nowhere.
        return self.impl.attention(q, k, v, world_size=self.shards, layout=self.layout, **options)

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.impl.attention_vjp(
            q, k, v, d_out, world_size=self.shards, layout=self.layout, **options
        )

    def _attention_packed(self, q, k, v, cu_q, cu_k, **options):
        # The packed tokens are one sequence, split over the ranks as attention's is.
        where = {"world_size": self.shards, "layout": self.layout}
        return self.impl.attention_packed(q, k, v, cu_q, cu_k, **where, **options)

    def _attention_packed_vjp(self, q, k, v, cu_q, cu_k, d_out, **options):
        where = {"world_size": self.shards, "layout": self.layout}
        return self.impl.attention_packed_vjp(q, k, v, cu_q, cu_k, d_out, **where, **options)

    def release(self) -> None:
        # The worker processes stop here, after each test module, rather than at exit:
        # a run that loads many P would otherwise keep a pool per P (measured: 16 processes,
        # 4.6 GiB, at P = 7 and 8). The next call starts a pool again.
        self.pool.shutdown()


class TorchUlyssesBackend(TorchRingBackend):
    """DeepSpeed-Ulysses on the torch-ring worker pool: ``dist.all_to_all_single`` (gloo)
    from sequence to head shards and back, uneven splits for any H and K.

    ``load_backend("torch-ulysses", shards=P, layout=...)``, defaults as torch-ring's. The
    impl takes its ranks' runner as ``run``; this backend gives it the worker pool
    torch-ring runs on, so both backends share one set of P processes. The
    backward is autograd on each rank's attention between the two hand-written reverse
    all-to-alls.
    """

    name = "torch-ulysses"
    impl_module = "conformance.impls.torch.ulysses"
    capabilities = TorchRingBackend.capabilities | {"sharded_heads"}

    def _run(self, fn, shards, **kwargs):
        return self.pool.run_on_ranks(self.shards, fn, shards, **kwargs)

    def _attention(self, q, k, v, *, seed=None, **options):
        return self.impl.attention(
            q, k, v, world_size=self.shards, layout=self.layout, run=self._run, **options
        )

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.impl.attention_vjp(
            q, k, v, d_out, world_size=self.shards, layout=self.layout, run=self._run, **options
        )

    def _attention_packed(self, q, k, v, cu_q, cu_k, **options):
        where = {"world_size": self.shards, "layout": self.layout, "run": self._run}
        return self.impl.attention_packed(q, k, v, cu_q, cu_k, **where, **options)

    def _attention_packed_vjp(self, q, k, v, cu_q, cu_k, d_out, **options):
        where = {"world_size": self.shards, "layout": self.layout, "run": self._run}
        return self.impl.attention_packed_vjp(q, k, v, cu_q, cu_k, d_out, **where, **options)


def _check_d_out_and_d_lse(outputs, cotangents) -> None:
    """d_out like the output, and d_lse shaped and typed like the lse (SPEC §21.4)."""
    (out, lse), (d_out, d_lse) = outputs, cotangents
    _check_d_out(out, d_out)
    if d_lse.shape != lse.shape:
        letters = "(B, H, T)" if lse.ndim == 3 else "(H, T)"
        raise ValueError(
            f"d_lse shape should be the lse's {letters} = {tuple(lse.shape)}, "
            f"got {tuple(d_lse.shape)}"
        )
    if d_lse.dtype != lse.dtype:
        raise TypeError(f"d_lse dtype should be {lse.dtype}, the lse's, got {d_lse.dtype}")


class TorchNaiveBackend(_TorchBackend):
    name = "torch-naive"
    capabilities = (
        (ALL_CAPABILITIES - {"module"})
        | (GRAD_CAPABILITIES - {"module_grad"})
        | {"sinks", "chunked", "alibi", "packed", "paged", "lse", "merge", "grad_lse"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.impl = _pages("naive")
        self.merge = _pages("merge")
        self.packed = _pages("packed").attention_packed
        self.paged = _pages("paged").attention_paged

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["generator"] = self.torch.Generator().manual_seed(seed)
        return self.impl.attention(q, k, v, **options)

    def _merge_states(self, o_a, lse_a, o_b, lse_b):
        return self.merge.merge_states(o_a, lse_a, o_b, lse_b)


class TorchSplitBackend(_TorchBackend):
    """Split-KV decoding (flash-decoding) in PyTorch, as ``numpy-split`` (SPEC §22.8):
    ``load_backend("torch-split", num_splits=N)``; left out, chunks of at most 1024 keys."""

    name = "torch-split"
    capabilities = (ALL_CAPABILITIES - {"dropout", "module"}) | {
        "sinks", "chunked", "alibi", "paged", "lse", "merge"
    }  # fmt: skip
    #: As numpy-split's: the suite's short rows split into three chunks of unequal lengths.
    conformance_options = MappingProxyType({"num_splits": 3})

    def __init__(self, *, num_splits: int | None = None) -> None:
        super().__init__()
        self.impl = _pages("split_kv")
        self.merge = _pages("merge")
        self.num_splits = num_splits
        self.options = {} if num_splits is None else {"num_splits": num_splits}

    def _attention(self, q, k, v, *, seed=None, **options):
        return self.impl.attention(q, k, v, num_splits=self.num_splits, **options)

    def _attention_paged(self, q, k_pages, v_pages, block_table, seq_lens, **options):
        return self.impl.attention_paged(
            q, k_pages, v_pages, block_table, seq_lens, num_splits=self.num_splits, **options
        )

    def _attention_vjp(self, q, k, v, d_out, **options):
        # Autograd would run through the page, but the backward is not declared: refused.
        raise NotImplementedError(f"{self.name} does not declare the 'grad' capability")

    def _merge_states(self, o_a, lse_a, o_b, lse_b):
        return self.merge.merge_states(o_a, lse_a, o_b, lse_b)


class TorchModuleBackend(_TorchBackend):
    """The nn.Module backend: the core spec runs the module's own attention function."""

    name = "torch-module"
    capabilities = (
        ALL_CAPABILITIES
        | GRAD_CAPABILITIES
        | {"sinks", "chunked", "alibi", "packed", "paged", "lse", "grad_lse"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.impl = _pages("module")
        self.layers = _pages("layers")
        # Packed and paged calls go to the module's own attention, document by document.
        self.packed = functools.partial(
            _pages("packed").attention_packed, attend=self.impl.attention
        )
        self.paged = functools.partial(_pages("paged").attention_paged, attend=self.impl.attention)

    def _attention(self, q, k, v, *, seed=None, **options):
        # The page's function as its signature says: dropout_p is its own keyword, drawn
        # from PyTorch's global generator, which the seed sets (a layer's nn.Dropout goes
        # to its dropout keyword instead: the layers' tests run that).
        if seed is not None:
            self.torch.manual_seed(seed)
        return self.impl.attention(q, k, v, **options)

    def _load(self, module, params):
        state = {n: self.from_numpy(p) for n, p in params.items()}
        dtype = next(iter(state.values())).dtype
        module = module.to(dtype)
        module.load_state_dict(state)
        return module.eval()

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        C = np.asarray(x).shape[-1]
        mha = self._load(self.layers.MultiHeadAttention(C, n_heads), params)
        mask = None if mask is None else self.from_numpy(mask)
        with self.torch.no_grad():
            return self.to_numpy(mha(self.from_numpy(x), mask=mask, is_causal=is_causal))

    def gpt_block(self, params, x, *, n_heads):
        C = np.asarray(x).shape[-1]
        F = np.asarray(params["mlp.0.weight"]).shape[0]
        block = self._load(self.layers.SelfAttentionBlock(C, n_heads, F), params)
        with self.torch.no_grad():
            return self.to_numpy(block(self.from_numpy(x)))

    def module_param_grads(self, kind, params, x, d_out, *, n_heads, is_causal=False):
        C = np.asarray(x).shape[-1]
        if kind == "mha":
            module = self._load(self.layers.MultiHeadAttention(C, n_heads), params)
        else:
            F = np.asarray(params["mlp.0.weight"]).shape[0]
            module = self._load(self.layers.SelfAttentionBlock(C, n_heads, F), params)
        x = self.from_numpy(x).requires_grad_(True)
        with self.torch.enable_grad():
            out = module(x, is_causal=is_causal) if kind == "mha" else module(x)
            out.backward(self.from_numpy(d_out))
        grads = {n: self.to_numpy(p.grad) for n, p in module.named_parameters()}
        return {**grads, "x": self.to_numpy(x.grad)}


class TorchSdpaBackend(_TorchBackend):
    """SDPA's own backward; softcap goes through flex_attention, which has no CPU backward."""

    name = "torch-sdpa"
    capabilities = (ALL_CAPABILITIES - {"module"}) | {
        "grad",
        "grad_mask",
        "chunked",
        "alibi",
        "packed",
        "paged",
        "lse",
    }

    def __init__(self) -> None:
        super().__init__()
        self.impl = _pages("sdpa")
        self.packed = _pages("packed").attention_packed_sdpa
        self.paged = functools.partial(_pages("paged").attention_paged, attend=self.impl.attention)

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            self.torch.manual_seed(seed)
        return self.impl.attention(q, k, v, **options)


class TorchFp8Backend(_TorchBackend):
    """Quantized attention (SPEC §20) on the PyTorch page, with torch's float8 dtypes:
    ``load_backend("torch-fp8", pipeline=...)``, FlashAttention-3's pipeline by default."""

    name = "torch-fp8"
    impl_module = "conformance.impls.torch.quantized"
    capabilities = QUANTIZED_CAPABILITIES
    dtypes = ("float32",)
    sections = ("20",)
    #: The page clamps before casting: torch's own e5m2 cast does not (SPEC §20.5).
    cast_rule = "saturate"

    def __init__(self, *, pipeline: str = "e4m3_unnormalized") -> None:
        super().__init__()
        self.impl = importlib.import_module(self.impl_module)
        self.quantized = quantized_form(pipeline, self.cast_rule)
        self.options = {"pipeline": pipeline} if pipeline != "e4m3_unnormalized" else {}

    def codes(self, x: np.ndarray):
        """float8 codes cross as their bytes (torch.from_numpy knows no ml_dtypes type)."""
        x = np.asarray(x)
        x = x if x.flags.c_contiguous else x.copy()  # ascontiguousarray would make () (1,)
        if x.dtype.name.startswith("float8"):
            raw = self.torch.from_numpy(x.view(np.uint8))
            return raw.view(getattr(self.torch, x.dtype.name))
        return self.torch.from_numpy(x)

    def to_numpy(self, x):
        if x.dtype in (self.torch.float8_e4m3fn, self.torch.float8_e5m2):
            import ml_dtypes

            fmt = str(x.dtype).removeprefix("torch.")
            return x.view(self.torch.uint8).numpy().view(getattr(ml_dtypes, fmt))
        return super().to_numpy(x)

    def _attention_quantized(self, q, k, v, *, out_format=None, **options):
        arrays = {n: options.pop(n) for n in ("q_descale", "k_descale", "v_descale")}
        for name in ("mask", "sinks"):
            if name in options:
                arrays[name] = options.pop(name)
        arrays = {n: self.codes(np.asarray(a)) for n, a in arrays.items()}
        if out_format is not None:
            options["out_format"] = out_format
        return self.impl.attention_quantized(
            self.codes(q), self.codes(k), self.codes(v), p_pipeline=self.quantized.pipeline,
            **arrays, **options,
        )  # fmt: skip
