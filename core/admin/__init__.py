"""The worker-side operator surface: what a worker embeds so that people and the cluster
can see and steer it.

- :mod:`quiesce.admin.server`: the admin HTTP API (drain, resume, status, health,
  metrics) on uvicorn, run inside the worker's event loop;
- :mod:`quiesce.admin.metrics`: the Prometheus exposition of one worker's lifecycle;
- :mod:`quiesce.admin.pod_deletion_cost`: the worker's drain cost published on its own
  pod, so a ReplicaSet scales down the cheapest worker to drain.

Imports the library (``quiesce.*``) only; imported by the workers (:mod:`quiesce.serve`)
and by a backend's own worker. Needs the ``server`` extra (``pip install 'quiesce[server]'``).
"""
