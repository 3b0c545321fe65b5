"""What runs in a rank process: the process itself (`process`, also `python -m flodl_run.rank`),
the runner that follows the coordinator's orders (`runner`) with its mode's part (`modes` picks
one of `exact_steps`, `collective_windows`, `central_windows`, `async_windows`), the model
replica, the worker handed to a recipe's loop, solo runs and the manual DDP API.

Layer 2: may import layers 0 and 1. Never imports `control`.
"""
