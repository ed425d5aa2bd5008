"""Data-parallel training: DataParallel and checkpoints."""
