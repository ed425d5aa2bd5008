"""What the runtime reads before it starts: the settings and this process's placement."""
