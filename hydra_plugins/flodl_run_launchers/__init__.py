"""flodl_run's Hydra launchers (Hydra instantiates launchers of the hydra_plugins package only):
`slurm` (Slurm through submitit, requeue resuming from the bundle) and `groups` (one host, jobs
side by side on their own GPUs and cores). Each imports its base plugin; nothing of flodl_run
loads until a sweep uses it.
"""
