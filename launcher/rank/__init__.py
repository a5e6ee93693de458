"""The rank side: what each process torchrun starts runs (`python -m launcher.rank RUN_DIR`):
the entry, the loop, checkpoints, metrics, the watchdog, preemption and fault injection.
It reads the frozen config.yaml and never composes Hydra configs."""
