"""The engine simulator: a model of continuous batching (``model``) behind an OpenAI-compatible
server (``server``)."""
