"""The market service: HTTP API, persistence, the per-second tick, ledger and webhooks.

Layers (STYLE 5): ``api`` routes open the transaction and map errors to HTTP; ``crud`` data
functions are keyword-only ``verb_noun(*, session, ...)`` and never commit; allocation status
changes only through ``gate.set_allocation_status``, called by the tick leader.
"""
