"""Small helpers every layer may use: atomic writes, sizes in bytes, bus bandwidth, spmd's own paths,
ranks and exit statuses in words."""
