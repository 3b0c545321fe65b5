"""The data plane on one rank: the reproducible pass permutation and batch gathering (`passes`),
picks and their transform keys (`picks`), the sample cache, prefetching, the per-rank delivery
plan (`dataplane`) and its metrics (`datametrics`).

Layer 1: may import `config`, `contracts`, `hardware`.
"""
