"""Engines: dense reference, paged, slab, H2O, offload (front doors at this level; layers in
kv/, sched/, exec/ and sim/). Selected by Hydra `_target_` configs."""
