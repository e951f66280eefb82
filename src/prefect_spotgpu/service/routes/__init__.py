"""The HTTP routes, one module per resource, each with its ``router`` (``api.create_app``
includes them). A route checks its path and body (``schemas``), opens the transaction (a
reading one for a ``GET``: ``deps.Db``), calls the data layer (``crud`` to change or read,
``queries`` for the reads only the routes make), and builds the response; the domain errors it
lets through become HTTP statuses in ``api``. No route writes SQL. Who may call each route is
in ``roles.ROUTE_ROLES``.

- ``tenants``: tenants, their credit, ``/me``; ``access``: the provider role, API keys and
  node tokens;
- ``nodes``: a provider's nodes; ``agents``: a node agent's own node, heartbeats, assignments,
  events and reports;
- ``bids``, ``allocations``, ``ledger``, ``webhook``: a tenant's own;
- ``images``: the operator's image catalogue (anyone reads it);
- ``prices``, ``forecast``, ``dashboard``, ``health``: public (quotes, history, the forecast and
  estimator, the dashboard and its market views).
"""
