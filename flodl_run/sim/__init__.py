"""`python -m flodl_run.sim`: what ElChe would do on a rig you describe (`rig`), without training;
`sweep` runs one rig over sizes, noise and window ends; `comparison` tables a `-m` sweep's jobs;
`measured` reads real run dirs into the rig's numbers (`python -m flodl_run.sim.measured RUN_DIR...`).

Layer 5 (an entry point): may import everything below; nothing imports it. `rig` itself is pure,
like the ElChe core it drives.
"""
