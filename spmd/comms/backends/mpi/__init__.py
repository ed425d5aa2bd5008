"""The mpi backend over mpi4py: the communicator, its buffers, its messages."""
