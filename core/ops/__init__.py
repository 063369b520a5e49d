"""The operator's tools: the ``quiesce`` command and what it shows.

- :mod:`quiesce.ops.cli`: the ``quiesce`` console script (``python -m quiesce``): the
  parser, serve, dynamo, demo;
- :mod:`quiesce.ops.operator_commands`: ``quiesce`` drain, resume, status, prestop;
- :mod:`quiesce.ops.doctor`: ``quiesce doctor``, an engine's sources checked for drift;
- :mod:`quiesce.ops.admin_client`: a small synchronous client of a worker's admin API;
- :mod:`quiesce.ops.status_format`: how a worker's status and a drain's progress read
  to a person;
- :mod:`quiesce.ops.demo`: ``quiesce demo``, the field report's scale-down replayed in a
  simulated cluster.

The top room: imports the library, the adapters, :mod:`quiesce.admin` and
:mod:`quiesce.serve` (the workers lazily, so that the CLI starts without the HTTP stack);
nothing in the package imports it but ``quiesce.__main__``.
"""
