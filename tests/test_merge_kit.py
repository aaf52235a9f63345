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

from conformance.adapters.profiles import ProfileError, read_profile
from conformance.suite.diagnosis import diagnose
from conformance.suite.helpers import random_qkv
from conformance.suite.misreadings import MERGE as MISREADINGS
from conformance.suite.pieces import key_parts, oracle_state, pieces_of

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


def test_a_merge_in_its_own_conventions_passes(tmp_path):
    """FlashInfer's conventions declared: every §22 test it runs passes but §22.5's. There
    the kit's conversion of lse = 1e4 to base 2 rounds it once in the function's dtype (an
    lse error of ulp(1e4 · log₂e), a relative error of that size in each piece's weight),
    which the pieces' natural-log tolerance does not allow: a limit of the kit's
    conversion, said in SPEC §22.5, not of the function."""
    good = dict(name="bth2", layout="BTHD", function="merge_bth_base2", lse_layout="BTH")
    run = _run(_profile(tmp_path, **good, base="2"))
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert failed and all("test_merge_does_not_overflow" in line for line in failed), run.stdout[
        -3000:
    ]
    assert " passed" in run.stdout.splitlines()[-1]


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
