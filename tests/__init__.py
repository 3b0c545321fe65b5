"""The test suite (tests/conftest.py says how it runs).

Every process the suite starts runs OpenMP's waiting threads passive (OMP_WAIT_POLICY, read
once, when torch loads libgomp: so here, before anything imports torch; a value the environment
sets is kept). The suite runs three workers on two cores, and an intra-op thread that spins
between two parallel regions burns a core another test needs. Measured with the whole suite on
the 2-core machine, one run each: 789 CPU-s and 464 s spinning, 717 CPU-s and 424 s passive.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
