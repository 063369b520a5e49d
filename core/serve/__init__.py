"""The reference worker and its faces: ``quiesce serve`` and ``quiesce dynamo``.

- :mod:`quiesce.serve.worker`: the reference worker (one engine, the serving API, the
  admin API, the budgeted shutdown), the integration example for backend authors;
- :mod:`quiesce.serve.dynamo_worker`: NVIDIA Dynamo's own worker with quiesce inside;
- :mod:`quiesce.serve.openai_api`: the OpenAI-compatible serving API, every request
  through the admission gate;
- :mod:`quiesce.serve.openai_protocol`: its request bodies and their one mapping to the
  engine's sampling;
- :mod:`quiesce.serve.options`: the options of ``quiesce serve`` and ``quiesce dynamo``,
  importable without the HTTP stack.

Imports the library, the adapters and :mod:`quiesce.admin`; imported only by the
operator's tools (:mod:`quiesce.ops`).
"""
