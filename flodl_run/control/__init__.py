"""The coordinator and its collaborators: the control plane of a distributed run (windows of
work, reduces, membership, saving, the async loop, and dispatch's pure planning).

Layer 2: may import layers 0 and 1. Never imports `rank`: the coordinator and the ranks share
only `contracts` (and what lies below).
"""
