"""Exit after drained: from the moment the real vLLM worker is drained to its process being gone.

Runs in the vLLM environment (``make bench`` runs it there)::

    .venv-vllm/bin/python -m bench.shutdown [--runs N] [--budget S] [--delivery NAME ...]

Each run starts ``quiesce serve --engine vllm`` on the tiny random-weight Llama of
``tests/integration/vllm/tiny_model.py`` (built once, shared by every run), starts
``STREAMS`` streaming completions, and once every stream has its first token delivers
the shutdown one way:

- ``kubelet``: ``quiesce prestop`` (admin drain, waits until drained), then SIGTERM to
  the main process, as the kubelet does;
- ``term_main``: SIGTERM to the main process only;
- ``term_group``: SIGTERM to the worker's process group (an init shim, ``kill -- -PGID``);
- ``term_all``: SIGTERM to every process of the worker, one by one (all descendants read
  from ``/proc``; systemd's control-group kill, ``pkill``);
- ``int_group``: SIGINT to the process group (a terminal's Ctrl-C).

It reads every stream to its end (a 200 answer whose SSE events carry an error, or that
never sent ``[DONE]``, is a lost stream), polls the admin API's status until it shows the
drain over, and watches each process of the worker in ``/proc`` (every 5 ms) until it is
gone. Deliveries the worker does not survive cleanly are recorded, not failed.

Writes ``bench/results/shutdown.json`` (format: :mod:`bench.results_format`).

The modules: :mod:`~bench.shutdown.one_run` (one run: the worker, the streams, the
delivery, what was observed until every process was gone), :mod:`~bench.shutdown.result`
(the runs within a time budget, and the metrics, targets and notes) and ``__main__``
(``python -m bench.shutdown``).
"""
