"""Pure scheduling logic: no I/O, no web framework, time comes from an injected clock."""
