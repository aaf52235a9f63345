"""JAX's persistent compilation cache: one per user, shared by every checkout and venv,
for the shipped backends and a user's own code alike, bounded in size (issues: a second
run that starts warm; a JAX function's second run in seconds)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.backends.jax_cache import (
    JAX_CACHE_MAX_BYTES,
    jax_cache_bound,
    jax_cache_dir,
    jax_cache_for_run,
    jax_cache_mode,
    trim_cache_folder,
)

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
    # By default the user's own code is cached with the shipped backends' programs;
    # "shipped" keeps a run of their code out, unless they set JAX's own variable
    # (which caches all their JAX code anyway).
    assert jax_cache_for_run(jax_cache_mode({}), own_code=True, environ=home) == shared
    assert jax_cache_for_run("shipped", own_code=True, environ=home) is None
    mine = {**home, "JAX_COMPILATION_CACHE_DIR": "/mine"}
    assert jax_cache_for_run("shipped", own_code=True, environ=mine) == Path("/mine")
    # "off" wins over everything, JAX's variable included.
    for own_code in (False, True):
        assert jax_cache_for_run("off", own_code=own_code, environ=mine) is None


def test_a_wrong_setting_is_refused_by_name():
    with pytest.raises(ValueError, match=r"CONFORMANCE_JAX_CACHE.*all, shipped, off.*'of'"):
        jax_cache_mode({"CONFORMANCE_JAX_CACHE": "of"})
    assert jax_cache_mode({}) == "all"
    with pytest.raises(ValueError, match=r"JAX_COMPILATION_CACHE_MAX_SIZE.*bytes.*'2G'"):
        jax_cache_bound({"JAX_COMPILATION_CACHE_MAX_SIZE": "2G"})
    with pytest.raises(ValueError, match="mode"):
        jax_cache_for_run("none", own_code=False, environ={})


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[int, str]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAX_") and k not in ("CONFORMANCE_JAX_CACHE", "XDG_CACHE_HOME")
    }
    environ.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(tmp_path), **env})
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


def test_a_users_own_jax_function_is_cached_and_read_back(tmp_path):
    pytest.importorskip("jax")
    (tmp_path / "mine.py").write_text(MINE)
    shared = tmp_path / "xdg" / "attention-conformance" / "jax"
    mine = ["--impl", "mine:attention", "--impl-framework", "jax"]
    code, cold = _run(tmp_path, *mine)
    assert code == 0, cold[-2000:]
    theirs = re.search(r"(\d+) programs compiled \(mine.attention\)", cold)
    assert theirs and _stored(shared) == int(theirs.group(1)) > 0, cold[-500:]
    # The second run compiles nothing new: every program is read back from the cache.
    stored = sorted(shared.iterdir())
    code, warm = _run(tmp_path, *mine)
    assert code == 0, warm[-2000:]
    assert f"{theirs.group(1)} programs compiled (mine.attention)" in warm, warm[-500:]
    assert sorted(shared.iterdir()) == stored
    # "shipped" keeps the user's code out of the cache.
    other = tmp_path / "other"
    code, out = _run(tmp_path, *mine, "--jax-cache", "shipped", XDG_CACHE_HOME=str(other))
    assert code == 0 and not other.exists(), out[-2000:]


def test_the_cache_is_trimmed_least_recently_used_first(tmp_path):
    for age, name in enumerate(["newest", "middle", "oldest"]):
        path = tmp_path / name
        path.write_bytes(b"x" * 100)
        os.utime(path, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
    assert trim_cache_folder(tmp_path, 250) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["middle", "newest"]
    assert trim_cache_folder(tmp_path, None) == 0 and trim_cache_folder(tmp_path / "none", 0) == 0
    assert trim_cache_folder(tmp_path, 0) == 2 and not list(tmp_path.iterdir())
    assert jax_cache_bound({}) == JAX_CACHE_MAX_BYTES
    assert jax_cache_bound({"JAX_COMPILATION_CACHE_MAX_SIZE": "-1"}) is None
    assert jax_cache_bound({"JAX_COMPILATION_CACHE_MAX_SIZE": "300"}) == 300


def test_a_run_trims_the_cache_to_its_bound(tmp_path):
    pytest.importorskip("jax")
    shared = tmp_path / "xdg" / "attention-conformance" / "jax"
    shared.mkdir(parents=True)
    (shared / "stale").write_bytes(b"x" * 1000)
    os.utime(shared / "stale", (0, 0))
    code, out = _run(
        tmp_path, "--backend", "jax", "--jax-cache", "shipped", JAX_COMPILATION_CACHE_MAX_SIZE="10"
    )
    assert code == 0, out[-2000:]
    assert not (shared / "stale").exists()


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
