"""Simulation mode: roofline cost model and calibration."""
