"""Communicators: ``Comm`` (base), the backend contract, the call path, the method families and the backends.

docs/comms.md is the reference; docs/architecture.md places this room among the others.
"""
