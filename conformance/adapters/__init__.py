"""Adapters for outside code: a user's function (``impl``), a library's own function called
as its users call it (``native``), and the shipped profiles that describe those calls
(``profiles``). They turn outside code into a ``conformance.backends.Backend``."""
