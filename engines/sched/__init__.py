"""Scheduling: sequences and groups (``sequence.py``) and the continuous-batching scheduler
(``scheduler.py``: queues, the admission rule, preemption). Tensor-free; talks to a KV
manager only through ``engines/kv/protocol.py``.
"""
