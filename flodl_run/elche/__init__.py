"""ElChe, the cadence balancer, as a functional core: phase, timing, election, batch counts,
anchor autotuning, the convergence guard, the LR-aware meta-controller, the throttle, and the
balancer that ties them together (`balancer.ElChe`).

Layer 1: pure decisions over values. No clock, socket, file, logger, tensor or tracker; imports
only itself and `config.schema` (tests/test_layers.py checks it).
"""
