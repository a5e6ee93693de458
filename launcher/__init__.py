"""launcher: a distributed training launcher for PyTorch (see README.md)."""
