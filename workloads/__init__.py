"""Workloads: seeded synthetic generators and recorded-trace replay."""
