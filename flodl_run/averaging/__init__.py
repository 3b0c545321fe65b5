"""Parameter averaging: flat parameter storage (and the optimizer moments that may ride the
reduce), the collective consensus and its math, the
central (coordinator-side) average, shared-memory slabs, tensor frames, and the outer optimizers
(SlowMo, DiLoCo).

Layer 1: may import `config`, `contracts`, `hardware`.
"""
