"""The ``spotgpu`` command line: ``app`` (the commands), ``access``, ``nodes`` and ``pool``
(their groups), ``views`` (tables and sparklines), ``stack`` (the local market, Prefect server
and agents), ``demo`` (``spotgpu demo``) and ``simulate`` (``spotgpu simulate``).

Nothing outside this package imports it: it is the outermost layer.
"""
