"""`loom eval`: how far a setting, a kernel or a quantization moves a model's predictions.

Perplexity over a text and the KL divergence of each predicted distribution from a reference
(another setting, another model file of the same vocabulary, or saved log-probabilities), as
llama.cpp's `llama-perplexity` and its `--kl-divergence` compute them. The text is chunked and
scored here (text.py), its tokens scored by the engine in this process (offline.py) or by any
OpenAI-compatible server (client.py), the distributions compared in metrics.py.
"""
