"""The launch side: one process that composes, validates, writes the run directory and
starts (or submits) the ranks. It never touches a GPU, and imports no torch when it is
imported (tests/unit/test_imports.py): `launcher --help` costs no CUDA or distributed import.

cli.py (the commands' entry and `launcher train`), args.py (the command line) and
compose.py (Hydra) at the front; then one room per concept: checks/ (the config checked
before anything is written), commands/ (plan, rehearse, data, export, a sweep's table),
rundir/ (the run directory), start/ (the ranks started and supervised here), submit/
(Slurm, Kubernetes)."""
