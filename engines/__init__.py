"""Engines: dense reference, paged, slab, H2O, offload. Selected by Hydra `_target_` configs."""
