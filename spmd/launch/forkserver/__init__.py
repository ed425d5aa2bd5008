"""``spmd run --preload``: ranks forked from a server that imported torch once.

The launcher drives a server through ``client.ForkServer`` (``kept.attach``
for one kept across launches); ``protocol`` is the wire format between them,
``server`` and ``keptserver`` the two servers' ``python -m`` entry points,
``safety`` the checks that forking is safe, ``process`` the process helpers.
docs/preload.md is the reference.  The package imports none of its modules,
so that ``python -m`` runs each server's module once.
"""
