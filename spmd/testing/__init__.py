"""Multi-rank tests under pytest: the ``spmd`` marker, the ``comm`` fixture, and what runs them.

Installing spmd enables the plugin (``pytest11`` entry point
``spmd.testing.plugin``; ``-p no:spmd`` disables it).  Under plain
``pytest`` a fork server forks each marked test's ranks (``local``,
``server``, ``rank``); under a launcher the world's ranks run the marked
tests on sub-communicators, several at a time (``world``, ``schedule``).
``merge`` makes pytest's one report of a test from its ranks' reports.
docs/testing-your-code.md is the user's reference.
"""
