"""``convforge run``: a whole network from the command line, and PyTorch's time on it."""
