"""vLLM's own server, side by side: vLLM's own drain against ``vllm serve`` with quiesce.

Runs in the vLLM environment (``make bench`` runs it there)::

    .venv-vllm/bin/python -m bench.vllm_serve

Both arms are vLLM's real server (``vllm serve``, the CPU build, on the tiny random-weight
Llama of ``tests/integration/vllm/tiny_model.py``; :mod:`tests.integration.vllm.
serve_process` starts it), engine steps paced to 20 ms so that every stream is mid-way
when the signal lands:

- **vLLM's own drain**: ``vllm serve --shutdown-timeout 60`` (vLLM 0.32: on SIGTERM the
  API server stops the engine client in ``drain`` mode, EngineCore keeps stepping until
  it has no work, held KV included, for up to 60 s);
- **quiesce**: ``vllm serve --middleware quiesce.serve.vllm_serve.QuiesceMiddleware``
  (``QUIESCE_VLLM_ARGS="--budget 60 --router-grace 0.2"``).

Per delivery (:data:`~tests.integration.vllm.serve_process.DELIVERIES`: main, group,
every process, SIGINT to the group), one fresh server of each arm: :data:`STREAMS`
streaming completions; once each has its first token, the signal; every stream read to
its end (a 200 whose events carry an error, or that never sent ``[DONE]``, is lost);
each process watched in ``/proc`` until gone. On the prefill worker of a NIXL pair
(``prefill_main``, ``prefill_group``: two ``vllm serve``, the decoder shared, a proxy
passing ``kv_transfer_params``; the decoder's ``kv_load_failure_policy`` is vLLM's
default ``fail``, so a pull from a prefill worker that left is a lost stream, never a
silent recompute): the prefill legs answered, the decoder held back from pulling, the
signal, then the pulls.

And the middleware's serving overhead on the same engine (no signal): a plain ``vllm
serve`` and one with the middleware, both up at once, loaded in alternating rounds of
:data:`OVERHEAD_CONCURRENCY` streams (throughput: completion tokens per second over each
round) and of sequential streams (time to first token).

Writes ``bench/results/vllm_serve.json``. Modules: :mod:`.runs` (one signalled server,
each arm), :mod:`.overhead`, :mod:`.result`.
"""
