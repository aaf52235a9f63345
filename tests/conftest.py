def pytest_configure(config):
    config.addinivalue_line("markers", "clause(number): the SPEC.md clause a test checks")
