"""The zoo: recipes for models from the ecosystem's own libraries, written as their users write them.

Each module is one recipe (conf/recipe/zoo_<name>.yaml picks it) that exercises one part of what
torch DDP trains: `resnet` (torchvision, BatchNorm buffers), `gpt2` (transformers causal LM: a
ModelOutput, tied embeddings), `bert_cls` (transformers encoder: dict batches, padding masks, a
pooler), `frozen` (requires_grad=False), `unused` (parameters unused on some steps), `checkpointed`
(non-reentrant activation checkpointing), `amp` (fp16 autocast, `recipe.amp`) and `compiled`
(torch.compile). `data` holds their data sets. Every model is built from a config, tiny enough for
an epoch of seconds on CPU ranks; nothing is downloaded. This package imports none of its modules,
so a recipe costs only its own library's import.
"""
