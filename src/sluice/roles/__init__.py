"""The processes Sluice runs, one module each: ``serve`` (everything in one process), ``gateway``
(the HTTP API on Redis) and ``worker`` (a dispatcher on Redis). Each has its own parser
(``configure_parser``) with only the flags it uses, and ``run``; the parts come from
:mod:`sluice.runtime`."""
