"""Simulation: the cost-model executor, stand-in tokens, and the fast-forward path
(``fast_forward.py``), the one boundary between the engine and decode runs.
"""
