"""Execution: executors that apply KV ops and run the model (torch; bounded caches; the
host tier of offload), paged attention in torch and Triton, the sampler.
"""
