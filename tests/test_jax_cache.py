"""JAX's persistent compilation cache: one per user, shared by every checkout and venv,
for the shipped backends; a user's own code only when they opt in (issue: a second run
that starts warm)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.backends.arrays import jax_cache_dir, jax_cache_for_run, jax_cache_mode

ROOT = Path(__file__).resolve().parent.parent
#: Three programs of the jax backend (float64, three lengths), and the same of an --impl.
SELECTION = ["conformance/tests/test_invariants.py", "-k", "rows_sum_to_one and full and float64"]

MINE = """
import math

import jax
import jax.numpy as jnp


def attention(q, k, v, *, mask=None, is_causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) * scale  # (B, H, T, S)
    T, S = scores.shape[-2:]
    allowed = jnp.ones((T, S), bool)  # (T, S)
    if is_causal:
        allowed = jnp.tril(allowed)  # (T, S)
    if mask is not None:
        allowed = allowed & mask  # (B, H, T, S)
    scores = jnp.where(allowed, scores, -jnp.inf)  # (B, H, T, S)
    weights = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))  # (B, H, T, S)
    return jnp.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
"""


def test_the_cache_is_in_the_users_cache_directory():
    # The XDG base directory convention: $XDG_CACHE_HOME, else ~/.cache.
    assert jax_cache_dir({"XDG_CACHE_HOME": "/x/cache", "HOME": "/home/u"}) == Path(
        "/x/cache/attention-conformance/jax"
    )
    assert jax_cache_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/attention-conformance/jax")
    # An empty or relative XDG_CACHE_HOME is ignored, as the convention says.
    for ignored in ("", "relative/cache"):
        assert jax_cache_dir({"XDG_CACHE_HOME": ignored, "HOME": "/home/u"}) == Path(
            "/home/u/.cache/attention-conformance/jax"
        )


def test_jaxs_own_variable_chooses_the_directory():
    environ = {"JAX_COMPILATION_CACHE_DIR": "/mine", "XDG_CACHE_HOME": "/x", "HOME": "/h"}
    assert jax_cache_dir(environ) == Path("/mine")
    assert jax_cache_for_run("shipped", own_code=False, environ=environ) == Path("/mine")


def test_which_runs_use_the_cache():
    home = {"HOME": "/h"}
    shared = Path("/h/.cache/attention-conformance/jax")
    assert jax_cache_for_run("shipped", own_code=False, environ=home) == shared
    # The cache is the whole process's: a run of the user's code leaves it off unless they
    # opt in, or set JAX's own variable (which caches all their JAX code anyway).
    assert jax_cache_for_run("shipped", own_code=True, environ=home) is None
    assert jax_cache_for_run("all", own_code=True, environ=home) == shared
    mine = {**home, "JAX_COMPILATION_CACHE_DIR": "/mine"}
    assert jax_cache_for_run("shipped", own_code=True, environ=mine) == Path("/mine")
    # "off" wins over everything, JAX's variable included.
    for own_code in (False, True):
        assert jax_cache_for_run("off", own_code=own_code, environ=mine) is None


def test_a_wrong_setting_is_refused_by_name():
    with pytest.raises(ValueError, match=r"CONFORMANCE_JAX_CACHE.*shipped, all, off.*'of'"):
        jax_cache_mode({"CONFORMANCE_JAX_CACHE": "of"})
    assert jax_cache_mode({}) == "shipped"
    with pytest.raises(ValueError, match="mode"):
        jax_cache_for_run("none", own_code=False, environ={})


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[int, str]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAX_") and k not in ("CONFORMANCE_JAX_CACHE", "XDG_CACHE_HOME")
    }
    environ.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONPATH=str(tmp_path), **env)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *SELECTION, "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )
    return run.returncode, run.stdout + run.stderr


def _stored(directory: Path) -> int:
    return len(list(directory.iterdir())) if directory.is_dir() else 0


def test_the_shipped_backends_fill_the_shared_cache_and_read_it_back(tmp_path):
    pytest.importorskip("jax")
    shared = tmp_path / "xdg" / "attention-conformance" / "jax"
    code, cold = _run(tmp_path, "--backend", "jax")
    assert code == 0, cold[-2000:]
    programs = re.search(r"(\d+) programs compiled \(jax\)", cold)
    assert programs and int(programs.group(1)) == _stored(shared) > 0, cold[-500:]
    # The second run, in two processes, reads every program back: nothing is stored anew,
    # and it counts the same programs as the cold run.
    code, warm = _run(tmp_path, "--backend", "jax", "-n", "2")
    assert code == 0, warm[-2000:]
    assert f"{programs.group(1)} programs compiled (jax)" in warm, warm[-500:]
    assert _stored(shared) == int(programs.group(1))


def test_the_off_setting_and_jaxs_variable(tmp_path):
    pytest.importorskip("jax")
    shared = tmp_path / "xdg" / "attention-conformance" / "jax"
    code, out = _run(
        tmp_path, "--backend", "jax", CONFORMANCE_JAX_CACHE="off", JAX_COMPILATION_CACHE_DIR="x"
    )
    assert code == 0 and _stored(shared) == 0 and not Path(ROOT, "x").exists(), out[-2000:]
    code, out = _run(tmp_path, "--backend", "jax", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "j"))
    assert code == 0 and _stored(shared) == 0 and _stored(tmp_path / "j") == 3, out[-2000:]


def test_a_users_own_jax_function_is_cached_only_when_they_opt_in(tmp_path):
    pytest.importorskip("jax")
    (tmp_path / "mine.py").write_text(MINE)
    shared = tmp_path / "xdg" / "attention-conformance" / "jax"
    mine = ["--backend", "jax", "--impl", "mine:attention", "--impl-framework", "jax"]
    code, out = _run(tmp_path, *mine)
    # Beside a shipped backend, in the same process: neither's programs are stored.
    assert code == 0 and "programs compiled (jax)" in out, out[-2000:]
    assert _stored(shared) == 0, out[-500:]
    code, out = _run(tmp_path, *mine, "--jax-cache", "all")
    assert code == 0, out[-2000:]
    shipped = re.search(r"(\d+) programs compiled \(jax\)", out)
    theirs = re.search(r"(\d+) programs compiled \(mine.attention\)", out)
    assert shipped and theirs, out[-500:]
    assert _stored(shared) > int(shipped.group(1)), out[-500:]


def test_the_users_code_is_what_the_project_does_not_ship(tmp_path):
    from types import SimpleNamespace

    from conformance.adapters import profiles
    from conformance.backends import load_backend
    from conformance.suite.plugin import PROFILES, _tests_own_code

    def own(backends, profile_dir):
        profile = SimpleNamespace(name="lib.attention", path=profile_dir / "lib.attention.toml")
        return _tests_own_code(SimpleNamespace(stash={PROFILES: ([profile], [])}), backends)

    shipped, profile = load_backend("numpy"), SimpleNamespace(name="lib.attention")
    assert not own([shipped], profiles.HERE)
    assert not own([shipped, profile], profiles.HERE)
    # The same profile from the user's folder, or an --impl of theirs, is their code.
    assert own([shipped, profile], tmp_path)
    assert own([shipped, SimpleNamespace(name="mine.attention")], profiles.HERE)
