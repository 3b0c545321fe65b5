"""flodl_run: config-first runner for heterogeneous data-parallel PyTorch training."""

__version__ = "0.1.0"
