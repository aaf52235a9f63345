"""``--impl-domain``: a plain ``--impl`` function declares its shapes as a profile's
``[domain]`` does (SPEC §13.19), one TOML line of the table per flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_domain import KERNELS, ROOT

from conformance.adapters.domain import domain_flags, parse_domain

FLAGS = ["--impl-domain", "head_dims=[16, 32]", "--impl-domain", "s_multiple=16"]


def _run(tmp_path, *args: str) -> tuple[int, str]:
    (tmp_path / "kern.py").write_text(KERNELS.format(drop_scale=False, leak=False))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance/tests/test_fixtures.py")]
        + ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0", "-rs"]
        + ["--impl", "kern:tiled", "--impl-mask", "none", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "KERNEL_LOG": str(tmp_path / "calls.jsonl")},
    )
    return run.returncode, run.stdout + run.stderr


@pytest.mark.clause("13.19")
def test_an_impl_declares_its_domain_with_flags(tmp_path):
    """The tiled kernel (it asserts D in {16, 32} and S % 16 == 0 inside itself) passes
    with its domain declared, and without it fails on the shapes it was never meant for."""
    code, out = _run(tmp_path, *FLAGS, "-k", "test_fixture_case")
    assert code == 0 and " passed" in out and " failed" not in out, out[-3000:]
    assert "kern.tiled judged on: dtypes float64, float32; forms it does not take: a bool " in out
    assert "shapes D, E in {16, 32}; S a multiple of 16" in out
    code, out = _run(tmp_path, "-k", "test_fixture_case and T7-S7")
    assert code == 1 and "AssertionError" in out, out[-3000:]


@pytest.mark.clause("13.19")
def test_a_failure_reruns_with_the_domain_flags(tmp_path):
    """A failure's rerun command repeats the flags (here a kernel whose domain is declared
    wider than it is: D = 64 is not its)."""
    code, out = _run(
        tmp_path, "--impl-domain", "head_dims=[64]", "-k", "test_fixture_case and T7-S7-float64"
    )
    assert code == 1, out[-3000:]
    assert "--impl-domain 'head_dims=[64]'" in out, out[-3000:]


def test_the_flags_are_the_profile_table():
    table = domain_flags(["head_dims={min=16, max=256, multiple=16}", "backward.square=true"])
    assert table == {
        "head_dims": {"min": 16, "max": 256, "multiple": 16},
        "backward": {"square": True},
    }
    domain = parse_domain(table, "--impl-domain")
    assert (
        domain.words()
        == "D, E in 16..256 in steps of 16 (backward: D, E in 16..256 in steps of 16; T = S)"
    )
    with pytest.raises(ValueError, match="--impl-domain should be KEY=VALUE"):
        domain_flags(["s_multiple 16"])
    with pytest.raises(ValueError, match="--impl-domain: unknown keys"):
        parse_domain(domain_flags(["tile=16"]), "--impl-domain")
