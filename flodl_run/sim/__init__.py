"""`python -m flodl_run.sim`: what ElChe would do on a rig you describe (`rig`), without training.

Layer 5 (an entry point): may import everything below; nothing imports it. `rig` itself is pure,
like the ElChe core it drives.
"""
