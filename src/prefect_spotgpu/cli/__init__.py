"""The ``spotgpu`` command line: ``app`` (the typer app and its wiring), ``common`` (the console,
the failure line, the market clients and options every command module shares), the commands by
what they touch (``service_cmds``, ``agent_cmds``, ``access``, ``nodes``, ``pool``,
``market_cmds``), ``views`` (tables and sparklines), ``stack`` (the local market, Prefect server
and agents), ``demo`` (``spotgpu demo``) and ``simulate`` (``spotgpu simulate``).

Nothing outside this package imports it: it is the outermost layer.
"""
