"""Starting a run: the launcher, the supervisor of rank processes, hosts over SSH, docker and
Slurm, torchrun agents, and the host probe (`python -m flodl_run.launch.probe`).

Layer 4: may import layers 0 to 3.
"""
