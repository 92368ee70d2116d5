"""The endpoint engine: kvbench workloads replayed against a live OpenAI-compatible server
(vLLM, SGLang, llama.cpp, TGI), launched per configuration or already running."""
