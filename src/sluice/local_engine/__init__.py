"""The local engine: llama.cpp's llama-server built from source (``build``) and supervised (``server``)."""
