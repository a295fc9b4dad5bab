"""Backends: the inference engines jobs run on."""
