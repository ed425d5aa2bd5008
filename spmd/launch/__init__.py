"""``spmd run``: starting and supervising local ranks, and the fork server."""
