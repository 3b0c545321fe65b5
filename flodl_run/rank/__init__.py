"""What runs in a rank process: the process itself (`process`, also `python -m flodl_run.rank`),
the model replica, the worker handed to a recipe's loop, solo runs and the manual DDP API.

Layer 2: may import layers 0 and 1. Never imports `control`.
"""
