"""One module or folder per backend: serial, mpi (mpi4py), torchdist (gloo, nccl, torch's mpi)."""
