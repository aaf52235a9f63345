"""The kit for other people's attention: --impl, known failures, entry points, replays."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance import backends
from conformance.adapters import impl
from conformance.backends import Backend, BackendUnavailable, available_backends, load_backend
from conformance.suite import known_failures, replay, verdicts
from conformance.suite.clauses import (
    LAYERS,
    _expand,
    clause_key,
    clause_titles,
    layer_of,
    layer_table,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = [
    "--impl",
    "examples.my_attention:attention",
    "--impl-capabilities",
    "value_dim,causal_bottom_right,window,gqa",
]


def _pytest(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "-q", "-p", "no:cacheprovider"]
        + list(args),
        cwd=cwd,
        capture_output=True,
        text=True,
    )


class KitBackend(Backend):
    """A backend as a third-party package would write it: the reference, renamed."""

    name = "kit-backend"
    capabilities = frozenset({"gqa"})
    dtypes = ("float64",)

    def _attention(self, q, k, v, **options):
        from conformance.impls.numpy.attention import attention

        return attention(q, k, v, **options)


# --- The worked example ----------------------------------------------------------------------


@pytest.mark.clause("13.1", "13.4")
def test_example_passes_with_its_known_failures():
    run = _pytest(*EXAMPLE, "--known-failures", "examples/known_failures.txt")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 xfailed" in run.stdout and "failed" not in run.stdout.replace("xfailed", "")


@pytest.mark.clause("13.5")
def test_example_without_known_failures_fails_with_diagnostics():
    run = _pytest(*EXAMPLE, "-k", "bad_input", "--repro-dir", "repro-unused-by-default")
    try:
        assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
        assert "test_bad_input[my_attention.attention-integer-mask]" in run.stdout
        assert "accepted an int64 mask; SPEC §8.1 wants TypeError" in run.stdout
        assert "finding: accepts an int64 mask (no error)" in run.stdout
        assert "load_call(" in run.stdout and "rerun: pytest --pyargs" in run.stdout
    finally:
        for path in (ROOT / "repro-unused-by-default").glob("*.npz"):
            path.unlink()
        (ROOT / "repro-unused-by-default").rmdir()


@pytest.mark.clause("13.1")
def test_example_runs_from_another_directory(tmp_path):
    """`pytest` (not `python -m pytest`) from the directory holding the user's module."""
    (tmp_path / "mine.py").write_text(
        (ROOT / "examples" / "my_attention.py")
        .read_text()
        .replace(
            "mask = mask != 0",
            'raise TypeError(f"mask dtype should be bool or floating, got {mask.dtype}")',
        )
    )
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "pytest"),
            str(ROOT / "conformance"),
            "-q",
            "-p",
            "no:cacheprovider",
            "--impl",
            "mine:attention",
            "-k",
            "fixture or bad_input",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@pytest.mark.clause("13.3")
@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:attention", "No module named 'no_such_module_xyz'"),
        ("examples.my_attention:nope", "has no attribute 'nope'"),
        ("examples.my_attention", "should be 'package.module:function'"),
        ("examples.my_attention:math", "not a function or a conformance.Backend"),
    ],
)
def test_unusable_impl_is_a_usage_error(spec, message):
    run = _pytest("--impl", spec)
    out = run.stdout + run.stderr
    assert run.returncode == 4, out[-3000:]
    assert message in out and "registered backends are" in out and "'numpy'" in out


@pytest.mark.clause("13.3")
def test_impl_flags_need_an_impl():
    run = _pytest("--backend", "numpy", "--impl-capabilities", "window")
    assert run.returncode == 4 and "--impl-capabilities describes an --impl" in run.stderr


# --- Known failures --------------------------------------------------------------------------


@pytest.mark.clause("13.4")
def test_known_failures_are_strict_and_stale_ids_warn(tmp_path):
    known = tmp_path / "known.txt"
    known.write_text(
        "# comment\n"
        "test_errors.py::test_bad_input[my_attention.attention-integer-mask]  # reads ints as bool\n"
        "test_bad_input[my_attention.attention-q-rank-2]  # claimed, but it passes\n"
        "test_no_such_test[x]  # stale\n"
    )
    run = _pytest(
        *EXAMPLE,
        "-k",
        "bad_input",
        "--known-failures",
        str(known),
        "-rfxX",
        "--repro-dir",
        str(tmp_path),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    # The listed failure is an expected failure, with its reason ...
    assert "XFAIL" in out and "known failure: reads ints as bool" in out
    # ... a listed test that passes fails the run (strict), so the fixed bug is noticed ...
    assert "[XPASS(strict)] known failure: claimed, but it passes" in out
    # ... the unlisted failure still fails, and the stale id is reported.
    assert "FAILED" in out and "uint8-mask" in out
    assert "StaleKnownFailure" in out and "test_no_such_test[x]" in out
    # A failure gets a replay; an expected one does not.
    saved = {path.name for path in tmp_path.glob("*.npz")}
    assert "test_bad_input_my_attention.attention-uint8-mask_.npz" in saved, saved
    assert not [name for name in saved if "integer-mask" in name], saved


@pytest.mark.clause("13.4")
def test_a_bare_test_name_covers_every_parametrization(tmp_path):
    known = tmp_path / "known.txt"
    known.write_text("test_bad_input  # all of them, for the test\n")
    run = _pytest(
        *EXAMPLE, "-k", "bad_input", "--known-failures", str(known), "--repro-dir", str(tmp_path)
    )
    # The two real failures are expected; every passing parametrization is an XPASS(strict).
    assert run.returncode == 1 and "2 xfailed" in run.stdout
    assert "[XPASS(strict)] known failure: all of them, for the test" in run.stdout


@pytest.mark.clause("13.4")
@pytest.mark.parametrize(
    "text, message",
    [
        ("test_x[a]\n", "give the reason after '#'"),
        ("test_x[a]  #   \n", "give the reason after '#'"),
        ("test_x  # a\ntest_x  # b\n", "listed twice"),
    ],
)
def test_known_failures_file_is_checked(tmp_path, text, message):
    path = tmp_path / "known.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        known_failures.read_known_failures(path)


@pytest.mark.clause("13.4")
def test_known_failure_keys():
    keys = known_failures.known_failure_keys(
        "conformance/tests/test_errors.py::test_bad_input[mine-integer-mask]", "test_bad_input"
    )
    assert keys == {
        "conformance/tests/test_errors.py::test_bad_input[mine-integer-mask]",
        "test_errors.py::test_bad_input[mine-integer-mask]",
        "test_bad_input[mine-integer-mask]",
        "test_errors.py::test_bad_input",
        "test_bad_input",
    }


@pytest.mark.clause("13.4")
def test_our_own_runs_use_no_known_failures():
    """Known failures are for other people's implementations, never for ours."""
    for path in [ROOT / "tox.ini", *ROOT.glob(".ci/*")]:
        if path.is_file():
            assert "--known-failures" not in path.read_text(), path


# --- Backends from functions, classes and entry points --------------------------------------


@pytest.mark.clause("13.1")
def test_function_backend_passes_only_what_it_is_given(registry):
    seen = []

    def attention(q, k, v, *, mask=None, is_causal=False, scale=None):
        seen.append({"mask": mask, "is_causal": is_causal, "scale": scale})
        return np.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)

    b = impl.FunctionBackend(attention, name="fn")
    q = np.ones((1, 1, 2, 3))
    b.attention(q, q, q, is_causal=True)
    assert seen == [{"mask": None, "is_causal": True, "scale": None}]
    assert b.capabilities == frozenset() and b.dtypes == ("float64", "float32")


@pytest.mark.clause("13.1")
def test_declared_capabilities_are_checked_against_the_signature(registry):
    with pytest.raises(ValueError, match=r"declares 'softcap'.*no 'softcap' parameter"):
        impl.resolve_impl("examples.my_attention:attention", capabilities="softcap")
    with pytest.raises(ValueError, match="unknown \\['flash'\\]"):
        impl.resolve_impl("examples.my_attention:attention", capabilities="flash")
    with pytest.raises(ValueError, match="unknown \\['float8'\\]"):
        impl.resolve_impl("examples.my_attention:attention", dtypes="float8")
    with pytest.raises(ValueError, match=r"declares 'sinks'.*no 'sinks' parameter"):
        impl.resolve_impl("examples.my_attention:attention", capabilities="sinks")
    with pytest.raises(ValueError, match="'packed' needs a second function"):
        impl.resolve_impl("examples.my_attention:attention", capabilities="packed")


def forwarding_attention(q, k, v, **options):
    """The reference's attention behind a signature that takes any keyword."""
    return load_backend("numpy").attention(q, k, v, **options)


def maskless_attention(q, k, v, scale=None):
    """The reference's attention behind a signature with no mask and no is_causal."""
    return load_backend("numpy").attention(q, k, v, scale=scale)


@pytest.mark.clause("13.17", "13.19")
def test_a_function_without_mask_or_is_causal_is_not_passed_them(registry):
    """A plain --impl whose signature has neither keyword is called with neither, as
    --impl-mask none and --impl-causal none declare it; a flag given says otherwise."""
    from conformance.adapters.forms import forms_of

    b = impl.resolve_impl("test_kit:maskless_attention")
    assert b.call.mask_bool is None and b.call.mask_float is None and b.call.causal == "none"
    assert "is_causal" not in b.call.options
    assert {"mask_bool", "mask_float"}.isdisjoint(forms_of(b))
    assert [words.split(":")[0] for words in b.assumed] == [
        "maskless_attention() has no 'mask' parameter",
        "maskless_attention() has no 'is_causal' parameter",
    ]
    told = impl.resolve_impl("test_kit:maskless_attention", mask="both", causal="mask")
    assert told.call.mask_bool == "mask" and told.call.causal == "mask" and not told.assumed
    # A signature with **kwargs takes them all, as before.
    open_ = impl.resolve_impl("test_kit:forwarding_attention")
    assert open_.call.mask_bool == "mask" and open_.call.options["is_causal"] == "is_causal"


@pytest.mark.clause("13.7", "13.17")
def test_the_summary_and_the_report_say_what_came_from_the_signature():
    """What was taken from a function's signature is part of what it was judged on: a line
    of the run's summary each, and a line of the report's section."""
    from conformance.report.markdown import render_domains
    from conformance.suite.domain_summary import DomainSummary

    b = impl.resolve_impl("test_kit:maskless_attention", name="mine")
    judged = DomainSummary([b]).judged()["mine"]
    assert judged["assumed"] == list(b.assumed) and len(b.assumed) == 2
    assert "forms it does not take: is_causal=True" in "; ".join(judged["on"])
    md = "\n".join(render_domains({"mine": judged}))
    assert (
        "  Taken from its signature, not declared: maskless_attention() has no 'mask' "
        "parameter: called with no mask" in md
    )
    # A function given every keyword assumes nothing and is not listed.
    assert "forwarding" not in str(
        DomainSummary(
            [impl.resolve_impl("test_kit:forwarding_attention", name="forwarding")]
        ).judged()
    )


@pytest.mark.clause("13.17")
def test_a_correct_function_without_a_mask_keyword_passes(tmp_path):
    """The kit run of a correct function that takes no mask: every test that ran passed
    (none failed on a keyword the suite passed it), and the summary names the forms it
    was not judged on."""
    (tmp_path / "plain.py").write_text(
        "from conformance.impls.numpy.attention import attention as reference\n\n\n"
        "def attention(q, k, v, is_causal=False, scale=None):\n"
        "    return reference(q, k, v, is_causal=is_causal, scale=scale)\n"
    )
    run = _user_run(tmp_path, "--pyargs", "conformance", "--impl", "plain:attention")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert re.search(r"\b\d{3,} passed", out) and "failed" not in out.splitlines()[-1]
    assert "forms it does not take: a bool mask; an additive float mask" in out
    assert "plain.attention: attention() has no 'mask' parameter: called with no mask" in out


@pytest.mark.clause("13.1", "15.1", "16.1", "17.1")
def test_a_function_declares_the_variants_beside_all(registry):
    """ "all" is what a function could declare before the variants; sinks, chunked and
    alibi are named beside it, and the function gets them as its keywords."""
    b = impl.resolve_impl("test_kit:forwarding_attention", capabilities="all,sinks,alibi,chunked")
    assert {"sinks", "alibi", "chunked", "window", "softcap"} <= b.capabilities
    assert "packed" not in b.capabilities and "module" not in b.capabilities
    q = np.zeros((1, 2, 4, 1))
    v = np.arange(8.0).reshape(1, 1, 4, 2).repeat(2, axis=1)
    expected = load_backend("numpy").attention(q, q, v, chunk_size=2, sinks=np.zeros(2))
    np.testing.assert_array_equal(b.attention(q, q, v, chunk_size=2, sinks=np.zeros(2)), expected)


@pytest.mark.clause("13.1")
def test_load_impl_registers_it_by_name(registry):
    b = impl.load_impl(
        "examples.my_attention:attention", capabilities="window,gqa", dtypes="float64"
    )
    assert b.name == "my_attention.attention"
    assert load_backend("my_attention.attention") is b
    assert "my_attention.attention" in available_backends()
    assert b.capabilities == {"window", "gqa"} and b.dtypes == ("float64",)


@pytest.mark.clause("13.1")
def test_impl_may_be_a_backend_class(registry):
    b = impl.load_impl("test_kit:KitBackend")
    assert isinstance(b, KitBackend) and b.name == "kit-backend"
    with pytest.raises(ValueError, match="declares its own capabilities"):
        impl.resolve_impl("test_kit:KitBackend", capabilities="window")


@pytest.mark.clause("13.1")
def test_an_impl_cannot_take_a_builtin_name(registry):
    with pytest.raises(ValueError, match="'numpy' is already taken"):
        impl.load_impl("examples.my_attention:attention", name="numpy")


@pytest.mark.clause("13.2")
def test_entry_point_backends_appear_in_available_backends(registry, monkeypatch):
    real = importlib.metadata.entry_points

    def entry_points(**kwargs):
        if kwargs.get("group") == backends.ENTRY_POINT_GROUP:
            return [
                importlib.metadata.EntryPoint(
                    name="kit-backend", value="test_kit:KitBackend", group=kwargs["group"]
                )
            ]
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert "kit-backend" in available_backends()
    assert isinstance(load_backend("kit-backend"), KitBackend)


@pytest.mark.clause("13.3")
def test_entry_point_that_cannot_import_is_loud(registry, monkeypatch):
    def entry_points(**kwargs):
        return [
            importlib.metadata.EntryPoint(
                name="broken", value="no_such_package_xyz:Backend", group=kwargs["group"]
            )
        ]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with pytest.raises(BackendUnavailable, match="'broken' cannot be loaded"):
        load_backend("broken")


# --- Replaying a failure ---------------------------------------------------------------------


@pytest.mark.clause("13.5")
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_recorded_calls_replay_bit_for_bit(tmp_path, dtype):
    from conformance.suite.helpers import random_qkv

    log = replay.new_call_log()
    b = replay.RecordingBackend(load_backend("numpy"), log)
    q, k, v = random_qkv(0, T=5, S=6, dtype=dtype)
    mask = np.random.default_rng(1).random((5, 6)) < 0.7
    first = b.attention(q, k, v, mask=mask, window=(2, None), scale=np.float64(0.5))
    b.attention(q, k, v)
    lines = replay.save_calls(tmp_path / "calls.npz", list(log))
    assert len(lines) == 2 and "window=(2, None)" in lines[0] and "mask=bool[5, 6]" in lines[0]
    assert "scale=0.5" in lines[0] and "np.float64" not in lines[0]
    backend, method, args, kwargs = replay.load_call(tmp_path / "calls.npz", index=0)
    assert method == "attention" and kwargs["window"] == (2, None)
    assert args[0].dtype == q.dtype
    again = backend.attention(*args, **kwargs)
    assert again.dtype == first.dtype and np.array_equal(again.view(np.uint8), first.view(np.uint8))


@pytest.mark.clause("13.5")
def test_gradient_and_module_calls_replay_with_the_backend_options(tmp_path):
    """attention_vjp and the module calls are recorded too, and the backend comes back with
    the options it was loaded with."""
    from conformance.suite.cases import load_case

    log = replay.new_call_log(size=3)
    flash = replay.RecordingBackend(load_backend("numpy-flash", block_q=4, block_k=8), log)
    ref = replay.RecordingBackend(load_backend("numpy"), log)
    case = load_case("grad-T5-S7-E3-float64")
    grads = ref.attention_vjp(*case.inputs(), case.d_out(), **case.options())
    mha = load_case("mha-float64")
    out = ref.multi_head_attention(mha.params(), mha.arrays["x"], n_heads=3)
    flash.attention(*case.inputs())
    lines = replay.save_calls(tmp_path / "calls.npz", list(log))
    assert lines[0].startswith("attention_vjp(") and lines[1].startswith("multi_head_attention(")
    assert "load_backend('numpy-flash', block_q=4, block_k=8)" in lines[2]
    backend, method, args, kwargs = replay.load_call(tmp_path / "calls.npz", index=0)
    again = getattr(backend, method)(*args, **kwargs)
    assert all(np.array_equal(x, y) for x, y in zip(again, grads))
    backend, method, args, kwargs = replay.load_call(tmp_path / "calls.npz", index=1)
    assert np.array_equal(getattr(backend, method)(*args, **kwargs), out)
    backend, method, args, kwargs = replay.load_call(tmp_path / "calls.npz", index=2)
    assert backend.options == {"block_q": 4, "block_k": 8}


@pytest.mark.clause("13.5")
def test_replay_snippet_runs_as_printed(tmp_path):
    """The snippet a failure carries is complete Python: run it as it is."""
    log = replay.new_call_log()
    b = replay.RecordingBackend(load_backend("numpy"), log)
    q = np.ones((1, 1, 2, 3))
    b.attention(q, q, q, is_causal=True)
    path = tmp_path / "calls.npz"
    snippet = replay.replay_snippet(path, replay.save_calls(path, list(log)))
    code = "\n".join(line[2:] for line in snippet.split("replay in Python:\n")[1].splitlines())
    scope: dict = {}
    exec(code, scope)
    assert np.array_equal(scope["result"], load_backend("numpy").attention(q, q, q, is_causal=True))


@pytest.mark.clause("13.5")
def test_recording_backend_passes_everything_else_through():
    b = replay.RecordingBackend(load_backend("numpy"), replay.new_call_log())
    assert b.name == "numpy" and b.capabilities == load_backend("numpy").capabilities
    assert b.versions() == load_backend("numpy").versions()


@pytest.mark.clause("13.6")
def test_hypothesis_profiles():
    """The profile "quick" (the default) is small and repeatable; "deep" draws many more."""
    from hypothesis import settings

    from conformance.suite.options import register_hypothesis_profiles

    register_hypothesis_profiles()

    quick, deep = settings.get_profile("quick"), settings.get_profile("deep")
    assert quick.max_examples == 25 and quick.derandomize and quick.deadline is None
    assert deep.max_examples == 500 and not deep.derandomize and deep.deadline is None


@pytest.mark.clause("13.6")
def test_property_tests_run_deep_on_request():
    run = _pytest(
        "--backend",
        "numpy",
        "-k",
        "properties",
        "--hypothesis-profile",
        "deep",
        "--hypothesis-show-statistics",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    passed = int(re.search(r"(\d+) passed", run.stdout).group(1))
    # Every property test ran its 500 examples, not just the first one that did.
    assert passed >= 2 and run.stdout.count("max_examples=500") == passed, run.stdout[-3000:]


@pytest.mark.clause("13.10")
def test_a_profile_path_does_not_move_the_rootdir(tmp_path):
    """``--impl-profile PATH`` and ``--impl-profile=PATH`` print the same test ids: the
    value written after a space is not taken for a test path that moves the rootdir."""
    profile_dir, user_dir = tmp_path / "profiles" / "deep", tmp_path / "user"
    profile_dir.mkdir(parents=True)
    user_dir.mkdir()
    text = (ROOT / "conformance" / "adapters" / "profiles" / "torch.sdpa.toml").read_text()
    text = text.replace('name = "torch.sdpa"', 'name = "mine"').split("\n[known_failures]")[0]
    (profile_dir / "mine.toml").write_text(text)
    path = str(profile_dir / "mine.toml")
    ids = []
    for form in (["--impl-profile", path], [f"--impl-profile={path}"]):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--pyargs",
                "conformance",
                *form,
                "-p",
                "no:cacheprovider",
            ]
            + ["-k", "test_worked_example", "-rA", "-q"],
            cwd=user_dir,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        ids.append(
            sorted(line.split()[1] for line in run.stdout.splitlines() if line.startswith("PASSED"))
        )
    assert ids[0] == ids[1] and len(ids[0]) == 2, ids
    assert not any(i.startswith("..") for i in ids[0]), ids


# --- Gradients through the kit, judged on the function (SPEC §12.1, §12.2) ---------------------

#: A correct torch function that computes float32 inputs in float64: its gradients at
#: overflowing scores are the oracle's exact ones, and it has no d_out of its own to check.
WIDER = """
import torch
import torch.nn.functional as F


def attention(q, k, v, *, mask=None, is_causal=False, scale=None):
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, is_causal=is_causal, scale=scale
    )
    return out.to(q.dtype)
"""


@pytest.mark.clause("12.1", "12.2")
def test_a_function_computing_wider_passes_the_gradient_edges(tmp_path):
    """The kit refuses a d_out of the wrong shape itself, in the contract's words, before
    autograd sees it; and the exact gradients at overflowing float32 scores pass. (In
    float64 the function is torch's own kernel, and is judged as such.)"""
    pytest.importorskip("torch")
    (tmp_path / "wider.py").write_text(WIDER)
    run = _pytest(
        "--impl=wider:attention",
        "--impl-framework=torch",
        "--impl-capabilities=grad",
        "-k",
        "test_overflowing_score_gradients and float32 or test_d_out_of_the_wrong_shape",
        "-p",
        "no:randomly",
        cwd=tmp_path,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "2 passed" in out, out[-2000:]


# --- Verdicts by layer, short failures, reruns (SPEC §13.18) ----------------------------------

#: A plain NumPy attention with two bugs of its own: a row with no key to attend is NaN
#: (edges, §4.3), and a bad scale is accepted (contract, §8.1); on ordinary inputs it is
#: right (math).
NAN_ROWS = """
import numpy as np


def attention(q, k, v, *, mask=None, is_causal=False, scale=None):
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2) * scale).astype(q.dtype)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    if is_causal:
        T, S = s.shape[-2:]
        s = np.where(np.tril(np.ones((T, S), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return ((w / w.sum(-1, keepdims=True)) @ v).astype(q.dtype)
"""


def _user_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`pytest --pyargs conformance ...` from a folder outside the checkout holding the
    user's module, as a user types it (so that the run is isolated, SPEC §13.13)."""
    (tmp_path / "nanrows.py").write_text(NAN_ROWS)
    return subprocess.run(
        [str(Path(sys.executable).parent / "pytest"), *args, "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _failures(out: str) -> dict[str, list[str]]:
    """Each failure's printed lines, by its test's name, pytest's header line included."""
    found: dict[str, list[str]] = {}
    name = None
    for line in out.splitlines():
        header = re.match(r"^_{3,} (\S+) _{3,}$", line)
        if header:
            name = header[1]
            found[name] = [line]
        elif re.match(r"^[=-]{3,} ", line) and not line.startswith("-" * 10 + " behaviour"):
            name = None
        elif name:
            found[name].append(line)
    return found


@pytest.mark.clause("13.18")
def test_every_clause_is_in_exactly_one_layer():
    clauses = sorted(clause_titles(), key=clause_key)
    seen: dict[str, list[str]] = {}
    for layer, tokens in layer_table().items():
        for token in tokens:
            expanded = _expand(token, clauses)
            assert expanded, f"§13.18's {layer} row names {token!r}, which holds no clause"
            for clause in expanded:
                seen.setdefault(clause, []).append(layer)
    assert set(layer_table()) == set(LAYERS)
    assert {c: ls for c, ls in seen.items() if len(ls) > 1} == {}
    assert sorted(set(clauses) - set(seen)) == []
    # The examples, by name.
    assert [layer_of(c) for c in ("6.3", "4.3", "4.7", "4.9", "2.5", "8.1", "12.12", "3.3")] == [
        "math",
        "edges",
        "edges",
        "edges",
        "edges",
        "contract",
        "edges",
        "contract",
    ]


@pytest.mark.clause("13.18", "13.5", "13.9")
def test_a_plain_run_reads_like_the_report(tmp_path):
    run = _user_run(
        tmp_path,
        "--pyargs",
        "conformance",
        "--impl",
        "nanrows:attention",
        "-k",
        "test_fully_masked_rows_are_zero or test_bad_input or test_fixture_case",
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    lines = run.stdout.splitlines()
    # The run ends with its behaviours, then one verdict line, then pytest's counts.
    assert lines[-1].startswith("=") and " failed" in lines[-1], out[-3000:]
    verdict = lines[-2]
    assert verdict.startswith("verdict nanrows.attention — math: conforms ("), verdict
    # Its rows with no key are NaN, also in a fixture of §3.7: an edge, not the math.
    assert re.search(r" · edges: departs on [§\d., ]*§3.7, [§\d., ]*§4.3\b", verdict), verdict
    assert re.search(r" · contract: departs on §8.1 \(accepts \d+ kinds of bad input\)$", verdict)
    start = lines.index(next(x for x in lines if x.startswith("=") and " conformance " in x))
    behaviour = [x for x in lines[start + 1 : -2]]
    nan = next(x for x in behaviour if "a query with no key to attend returns NaN, not 0" in x)
    assert re.match(r"^\d+ tests · §[\d.]+(, §[\d.]+)* · nanrows.attention: ", nan), nan
    rerun = nan.split(" · rerun: ", 1)[1]
    assert rerun.startswith("pytest --pyargs 'conformance.tests.") and "nanrows:attention" in rerun
    # Each failure: at most 15 lines, its finding first, no source of the suite, and the
    # command that reruns it last.
    failures = _failures(run.stdout)
    assert failures, out[-3000:]
    for name, printed in failures.items():
        assert len(printed) <= verdicts.MAX_FAILURE_LINES, "\n".join(printed)
        body = [x for x in printed[1:] if not x.startswith("[gw")]
        assert body[0].startswith("finding: "), printed
        assert printed[-1].startswith("rerun: pytest --pyargs 'conformance.tests."), printed
        assert name in printed[-1], printed
        assert not any("def assert_" in x or "suite/tolerance.py" in x for x in printed)
    # The rerun command, run from the same folder, reruns exactly that test.
    again = subprocess.run(
        shlex.split(rerun) + ["-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert re.search(r"=+ 1 failed[ ,]", again.stdout), again.stdout[-3000:]


@pytest.mark.clause("13.18")
def test_one_layer_runs_alone(tmp_path):
    run = _user_run(
        tmp_path,
        "--pyargs",
        "conformance",
        "--impl",
        "nanrows:attention",
        "--layer",
        "contract",
        "-k",
        "test_fully_masked_rows_are_zero or test_bad_input",
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    verdict = run.stdout.splitlines()[-2]
    assert "math: not run (--layer contract)" in verdict, verdict
    assert "edges: not run (--layer contract)" in verdict, verdict
    assert "contract: departs on §8.1" in verdict, verdict
    assert "test_fully_masked_rows_are_zero" not in run.stdout
    wrong = _user_run(
        tmp_path, "--pyargs", "conformance", "--impl", "nanrows:attention", "--layer", "maths"
    )
    assert wrong.returncode == 4 and "the layers are math, edges, contract" in wrong.stderr


@pytest.mark.clause("13.13")
def test_x_on_a_failing_function_exits_1(tmp_path):
    """An isolated run (one xdist worker) stopped by -x exits as pytest does: 1, not 2."""
    run = _user_run(tmp_path, "--pyargs", "conformance", "--impl", "nanrows:attention", "-x")
    out = run.stdout + run.stderr
    assert "[gw0]" in out, out[-3000:]  # isolated, in a worker
    assert run.returncode == 1, out[-3000:]
    assert "stopping after 1 failures" in out and "1 failed" in out
    assert "Interrupted" not in out, out[-3000:]


@pytest.mark.clause("13.18", "13.12")
def test_the_replay_shows_the_call_as_the_function_received_it(tmp_path):
    """With --impl-mask additive the function receives a float mask where the suite passed
    a bool one: the replay shows both."""
    run = _user_run(
        tmp_path,
        "--pyargs",
        "conformance.tests.test_invariants",
        "--impl",
        "nanrows:attention",
        "--impl-mask",
        "additive",
        "-k",
        "test_fully_masked_rows_are_zero and float64 and bool",
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert (
        "attention(float64[2, 3, 13, 5], float64[2, 3, 7, 5], float64[2, 3, 7, 5], mask=bool[13, 7])"
        in out
    )
    received = "as the function received it: attention(float64[2, 3, 13, 5], float64[2, 3, 7, 5], float64[2, 3, 7, 5], mask=float64[13, 7])"
    assert received in out, out[-3000:]


@pytest.mark.clause("13.18")
def test_a_failure_counts_in_the_layer_its_behaviour_names():
    assert verdicts.layer_of_failure("6.3", "departs from §6.3 (No future leakage)") == "math"
    edge = "a query with no key to attend returns NaN, not 0"
    assert verdicts.layer_of_failure("3.7", edge) == "edges"
    refusal = "raises RuntimeError, not ValueError, for 2-d cu_seqlens"
    assert verdicts.layer_of_failure("18.1", refusal) == "contract"
    assert verdicts.layer_of_failure("18.1", "accepts scale = 0 (no error)") == "contract"

    def row(clause, outcome, behaviour="", backend="f"):
        layer = verdicts.layer_of_failure(clause, behaviour) if behaviour else layer_of(clause)
        return {
            "backend": backend,
            "clause": clause,
            "layer": layer,
            "outcome": outcome,
            "behaviour": behaviour,
            "test": f"t{clause}",
            "rerun": "pytest ...",
        }

    rows = [
        row("6.3", "passed"),
        row("3.7", "failed", edge),
        row("4.9", "xfailed", "a NaN in the inputs becomes a number in the output"),
        row("8.1", "failed", "raises RuntimeError, not ValueError, for a q of rank 5"),
        row("8.1", "failed", "raises RuntimeError, not TypeError, for an int64 mask"),
        row("6.3", "passed", backend="g"),
        row("8.1", "skipped", backend="g"),
    ]
    assert verdicts.verdict_lines(rows, ["f", "g"], []) == [
        "verdict f — math: conforms (1 test) · edges: departs on §3.7, §4.9 (2 behaviours) · "
        "contract: departs on §8.1 (RuntimeError where TypeError; RuntimeError where ValueError)",
        "verdict g — math: conforms (1 test) · edges: not run · "
        "contract: not run (every test skipped)",
    ]
    lines = verdicts.behaviour_lines(rows)
    assert "1 test (1 known) · §4.9 · f: a NaN in the inputs" in lines[0]
    assert lines[1] == f"1 test · §3.7 · f: {edge} · rerun: pytest ..."
    assert lines[2].startswith(
        "1 test · §8.1 · f: raises RuntimeError, not TypeError, for an int64"
    )
