"""The pytest suite's machinery: the plugin (``plugin``, the ``pytest11`` entry point) and
what the tests in ``conformance/tests`` use: cases, tolerances, requirements, behaviours,
clause titles, measurements, known failures and the replay of saved calls."""
