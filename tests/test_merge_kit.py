"""The kit and the merge (SPEC §22): a profile's [merge] table, and the misreadings named.

A profile names a merge function with its conventions (``conformance/adapters/merge.py``);
the suite hands it the spec's pieces and reads its answer back. A correct merge in
FlashInfer's conventions (o (B, T, H, E), lse (B, T, H) in base 2) passes §22 declared as
it is, and fails declared in the spec's own conventions. Each misreading of
``MERGE`` in ``conformance/suite/misreadings.py`` is planted in a correct merge
(``tests/merge_functions.py``) and named by the diagnosis; the right merge is named by
nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import merge_functions
import numpy as np
import pytest
from conformance.fixtures import oracle_merge

from conformance.adapters.merge import MergeFunction
from conformance.adapters.profiles import ProfileError, read_profile
from conformance.suite.diagnosis import diagnose
from conformance.suite.helpers import random_qkv
from conformance.suite.misreadings import MERGE as MISREADINGS
from conformance.suite.pieces import conversion_share, key_parts, oracle_state, pieces_of
from conformance.tests.test_merge import _far_apart

pytestmark = pytest.mark.clause("22.10")
BY_NAME = {m.name: m for m in MISREADINGS}

ROOT = Path(__file__).resolve().parent.parent
PROFILE = """
name = "{name}"
target = "examples.my_attention:attention"
layout = "{layout}"
capabilities = ["merge"]
[merge]
function = "merge_functions:{function}"
layout = "{lse_layout}"
base = "{base}"
"""


def _profile(tmp_path: Path, **given) -> Path:
    path = tmp_path / f"{given['name']}.toml"
    path.write_text(PROFILE.format(**given))
    return path


def _run(profile: Path) -> subprocess.CompletedProcess:
    tests = Path(__file__).resolve().parent
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance" / "tests" / "test_merge.py"),
         "--impl-profile", str(profile), "-q", "-p", "no:cacheprovider", "-n", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": f"{tests}:{ROOT}"},
    )  # fmt: skip


@pytest.mark.clause("22.10", "22.12")
def test_a_merge_in_its_own_conventions_passes(tmp_path):
    """FlashInfer's conventions declared: every §22 test it runs passes, §22.5's pieces
    1e4 apart included, where the kit's conversion of each lse to base 2 rounds it in the
    function's dtype: that rounding's share of the tolerance is derived (SPEC §22.12), so a
    correct base-2 merge conforms."""
    good = dict(name="bth2", layout="BTHD", function="merge_bth_base2", lse_layout="BTH")
    run = _run(_profile(tmp_path, **good, base="2"))
    assert run.returncode == 0, run.stdout[-3000:]
    assert "test_merge_does_not_overflow" not in run.stdout
    assert "bth2 — math: conforms" in run.stdout, run.stdout[-3000:]


@pytest.mark.clause("22.12")
def test_the_conversion_share_is_what_the_rounding_moves():
    """SPEC §22.12's share on §22.5's pieces: at least what the kit's rounding moves the
    50-digit merge of the pieces as a base-2 function reads them (it must not fail a
    correct merge), and at most a few times that (it must not hide a wrong one)."""
    kit = MergeFunction(merge_functions.merge_bth_base2, None, lse_base="2")
    # float32: float64 holds what the function reads (its base-2 lse times ln 2) exactly
    # enough to see the move; a float64 lse's move is below float64's own resolution.
    for dtype in ("float32",):
        a, b = _far_apart(dtype)
        expected = oracle_merge.merge_states([a, b])
        # What the function reads, in natural units, unrounded: its base-2 lse times ln 2.
        read = [(o, kit._lse_in(lse).astype(np.float64) * np.log(2.0)) for o, lse in (a, b)]
        moved = oracle_merge.merge_states(read)
        finite = np.isfinite(expected[0]) & np.isfinite(moved[0])
        o_moved = float(np.max(np.abs(np.where(finite, moved[0] - expected[0], 0.0))))
        o_share, lse_share = conversion_share([a, b], expected, kit.conversion)
        assert o_moved > 0, dtype
        assert o_moved <= o_share <= 8 * o_moved, (dtype, o_moved, o_share)


def test_the_base_declared_wrong_fails(tmp_path):
    """The same merge declared in base e: its lse comes back off by log 2, and fails."""
    wrong = dict(name="bth_e", layout="BTHD", function="merge_bth_base2", lse_layout="BTH")
    run = _run(_profile(tmp_path, **wrong, base="e"))
    assert run.returncode == 1 and "test_merge_is_attention_over_the_union" in run.stdout


@pytest.mark.parametrize(
    ("function", "sentence"),
    [
        ("merge_averaged", BY_NAME["merge-averaged"].sentence),
        ("merge_unguarded", BY_NAME["merge-empty-nan"].sentence),
    ],
)
def test_a_planted_misreading_is_named_in_the_run(tmp_path, function, sentence):
    """Run through the kit, a planted misreading's failures say its sentence."""
    plain = dict(name=function, layout="BHTD", function=function, lse_layout="BHT")
    run = _run(_profile(tmp_path, **plain, base="e"))
    assert run.returncode == 1
    assert sentence in run.stdout, run.stdout[-3000:]
    # The suite's own reference merges warn of nothing in the user's run (§22.5's huge
    # lse overflow in them as in the function): only the function's own warnings show.
    assert "conformance/suite/" not in run.stdout.partition("warnings summary")[2], run.stdout


def test_test_ids_carry_their_module_from_outside_the_checkout(tmp_path):
    """Run as a user runs it, ``--pyargs`` from a folder of their own: the FAILED lines and
    ``--co`` name each test with its module, never ``::test_...`` alone."""
    profile = _profile(
        tmp_path, name="avg", layout="BHTD", function="merge_averaged", lse_layout="BHT", base="e"
    )
    tests = Path(__file__).resolve().parent
    for extra in (["--co"], []):
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--pyargs", "conformance.tests.test_merge",
             "--impl-profile", str(profile), "-q", "-p", "no:cacheprovider", "-n", "0", *extra],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
            env={**__import__("os").environ, "PYTHONPATH": f"{tests}:{ROOT}"},
        )  # fmt: skip
        lines = run.stdout.splitlines()
        named = [
            line for line in lines
            if line.startswith(("FAILED", "conformance", "::"))
            and "test_merge_does_not_overflow[avg-float32]" in line
        ]  # fmt: skip
        assert named, run.stdout[-2000:]
        assert all("conformance/tests/test_merge.py::test_" in line for line in named), named
        assert not any(line.startswith(("::", "FAILED ::")) for line in lines), run.stdout


def _pieces(dtype: str = "float64"):
    q, k, v = random_qkv(95, B=2, H=3, T=7, S=13, D=5)
    a, b = pieces_of(q, k, v, key_parts(13, 2, 96), dtype, is_causal=True)
    return a, b, oracle_state(q, k, v, is_causal=True)


def test_the_diagnosis_names_each_misreading_and_nothing_else():
    """On pieces with empty rows (causal: early rows see no key of a late piece), each
    planted merge's o or lse is named by its misreading; the right merge's by nothing."""
    a, b, _ = _pieces()
    # Rows where both pieces are empty, beside rows of lse near 1000, where exp(lse)
    # without the maximum would overflow: only the unguarded subtraction fails there.
    lse_a, lse_b = a[1] + 1000.0, b[1] + 1000.0
    lse_a[..., 0], lse_b[..., 0] = -np.inf, -np.inf
    empty_rows = ((a[0], lse_a), (b[0], lse_b))
    large = ((a[0], a[1] + 1000.0), (b[0], b[1] + 1000.0))
    cases = {
        "merge-averaged": (merge_functions.merge_averaged, (a, b), 0),
        "merge-other-pieces-lse": (merge_functions.merge_other_lse, (a, b), 0),
        "merge-base-2-on-base-e": (merge_functions.merge_base2_on_e, (a, b), 1),
        "merge-empty-as-zero": (merge_functions.merge_empty_as_zero, (a, b), 0),
        "merge-empty-nan": (merge_functions.merge_unguarded, empty_rows, 0),
        "merge-exp-without-maximum": (merge_functions.merge_without_maximum, large, 0),
    }
    assert set(cases) == set(BY_NAME)
    by_name = {m.name: m.sentence for m in MISREADINGS}
    for name, (merge, (x, y), part) in cases.items():
        args = (x[0], x[1], y[0], y[1])
        got = merge(*args)[part]
        calls = [(0, None, "merge_states", args, {})]
        assert diagnose(got, calls, 1e-12) == by_name[name], name
    from conformance.impls.numpy.merge import merge_states

    args = (a[0], a[1], b[0], b[1])
    for part in (0, 1):
        right = merge_states(*args)[part]
        assert diagnose(right, [(0, None, "merge_states", args, {})], 1e-12) is None


def test_a_profile_names_merge_and_its_table_together(tmp_path):
    """The capability and the table go together; the table's values are checked."""
    path = tmp_path / "p.toml"
    path.write_text('name = "p"\ntarget = "m:f"\ncapabilities = ["merge"]\n')
    with pytest.raises(ProfileError, match="go together"):
        read_profile(path)
    path.write_text(
        'name = "p"\ntarget = "m:f"\ncapabilities = ["merge"]\n'
        '[merge]\nfunction = "m:g"\nbase = "10"\n'
    )
    with pytest.raises(ProfileError, match="base should be one of"):
        read_profile(path)


def test_a_merge_only_profile_needs_no_attention_target(tmp_path):
    """A profile with a [merge] table and no target: §22 runs on the merge alone, the
    other sections are skipped by that name, and the run's summary names no form of
    attention (a merge takes none)."""
    path = tmp_path / "merge_only.toml"
    text = (
        'name = "merge-only"\nlayout = "BTHD"\ncapabilities = ["merge"]\n'
        '[merge]\nfunction = "merge_functions:merge_bth_base2"\nlayout = "BTH"\nbase = "2"\n'
    )
    path.write_text(text)
    run = _run(path)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "merge-only — math: conforms" in run.stdout, run.stdout[-2000:]
    assert "forms it does not take" not in run.stdout and "judged on" not in run.stdout
    backend = read_profile(path).resolve()
    with pytest.raises(NotImplementedError, match="merge-only profile"):
        backend.attention(*random_qkv(1, B=1, H=1, T=2, S=2, D=2))
    path.write_text(text.replace('["merge"]', '["merge", "gqa"]'))
    with pytest.raises(ProfileError, match="'merge' alone"):
        read_profile(path).resolve()


def test_the_merge_capability_without_a_merge_function_is_a_usage_error(tmp_path):
    """``--impl mod:merge --impl-capabilities merge`` has no merge function to judge (a
    plain --impl names attention): a usage error that says where one is named, its
    section number as written, before any test runs."""
    tests = Path(__file__).resolve().parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance.tests.test_merge",
         "--impl", "merge_functions:merge_averaged", "--impl-capabilities", "merge",
         "-q", "-p", "no:cacheprovider", "-n", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": f"{tests}:{ROOT}"},
    )  # fmt: skip
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:]
    assert "[merge] table names (SPEC §22.10)" in run.stderr, run.stderr


def test_a_section_number_in_a_refusal_is_kept():
    """A function's message names its section (§22) as written: numbers become N in a
    behaviour's words (a size, an index), never a section's."""
    from conformance.suite.behaviours import _first_line

    line = _first_line("f names no merge function (SPEC §22.10), got 3 pieces of 1.5e-3")
    assert line == "f names no merge function (SPEC §22.10), got N pieces of N"
