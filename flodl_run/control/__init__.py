"""The coordinator and its collaborators: the control plane of a distributed run (the message
pump, membership, the mode's part chosen in `modes`: exact steps, windows with a collective or
central round, async chunks; the round book, the non-finite ledger, saving, epochs, and
dispatch's pure planning).

Layer 2: may import layers 0 and 1. Never imports `rank`: the coordinator and the ranks share
only `contracts` (and what lies below).
"""
