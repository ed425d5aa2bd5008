"""Communicator implementations: the interface and one module per backend."""
