"""Hydra configuration package (pkg://kvbench.conf)."""
