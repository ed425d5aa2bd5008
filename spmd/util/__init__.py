"""Small helpers every layer may use: atomic writes, sizes in bytes, spmd's own paths."""
