import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "clause(number): the SPEC.md clause a test checks")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist keeps on one worker")


@pytest.fixture
def registry(monkeypatch):
    """A fresh backend registry for one test: what the test registers is forgotten after it."""
    from conformance import backends, impl

    fresh = backends.Registry(backends.BUILTIN)
    monkeypatch.setattr(backends, "REGISTRY", fresh)
    monkeypatch.setattr(impl, "LOADERS", {})
    return fresh
