"""What a communicator keeps between calls: caches, results pool, plans, array descriptions."""
