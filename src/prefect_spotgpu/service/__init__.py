"""The market service: HTTP API, persistence, the per-second tick, ledger and webhooks.

Layers (docs/development/code-style.md#style-5): ``api.create_app`` builds the app; ``routes`` (one
module per resource) open the transaction and map errors to HTTP, and read and write only through
``crud`` (data functions, keyword-only ``verb_noun(*, session, ...)``, never commit) and
``queries`` (the
routes' reads). Allocation rows are written only by the tick leader (``ticker`` and its rooms:
``leader``, ``market_rows``, ``changes``, ``ledger``, ``tick_writes``), through ``gate``.
"""
