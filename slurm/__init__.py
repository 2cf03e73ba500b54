"""Multi-node launch under Slurm: train.sbatch and the command builder launch.py (importable for tests)."""
