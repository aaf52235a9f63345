"""The report: ``python -m conformance report`` (``command``) runs the spec, collects the
outcomes (``collect``), sorts them (``outcomes``, ``agreement``), draws (``pictures``) and
writes them out (``markdown``)."""
