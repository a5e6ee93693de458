"""Submit backends: Slurm (slurm.py: sbatch) and Kubernetes (k8s.py: job.yaml, kubectl)."""
