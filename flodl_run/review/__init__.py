"""`python -m flodl_run.review`: the materialized run config as a table or a diff to review
(`table`), what a change does to the run (`meaning`), the named experiments' snapshots and the
check that fails when one drifts (`snapshots`), and the pull-request workflow (`workflow`).

Layer 5 (an entry point): may import everything below, and the simulated rig (`sim.rig`, pure)
and its measured speeds (`sim.measured`), which are library code of the sim, not its CLI;
nothing imports it.
"""

from flodl_run.review.table import SECTIONS, materialized, preset, section_of  # noqa: F401
