"""`python -m flodl_run.bench`: every mode against the fair peers (bare loop, torch DDP, torch
local SGD) on one rig, its report and its MLflow tracking.

Layer 5 (an entry point): may import everything below; nothing imports it.
"""
