"""The OpenAI-compatible server: continuous batching, per-request sampling, constrained output."""
