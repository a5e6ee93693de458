"""The launch side: one process that composes, validates, writes the run directory and
starts (or submits) the ranks. It never touches a GPU, and imports no torch when it is
imported (tests/unit/test_imports.py): `launcher --help` costs no CUDA or distributed import."""
