"""The worker's parallel layout as SGLang resolved it, read in the main process.

Runs in: the worker's main process, once per probe (server arguments do not change
while an engine runs).

SGLang 0.5.23 resolves its arguments after construction (``ServerArgs.resolve_once``):
the resolved values are declarations on the record (``arg_groups.overrides.
resolution_result``), while the raw fields keep the user's input. So with
``--attn-dp-size 2`` the raw ``server_args.dp_size`` stays 1, and with the deprecated
``--dp-size 2 --enable-dp-attention`` it stays 2 although resolution moved that width to
``attn_dp_size``. What counts:

- **DP ranks** (:func:`dp_ranks_of`): ``dp_size * attn_dp_size`` after resolution
  (``runtime_context.num_dp_ranks_of``: replicas times attention-DP groups). That is the
  TokenizerManager's ``get_internal_state`` fan-out (``get_parallel().num_dp_ranks``)
  and the number of load-snapshot slots: every attention-DP group leader answers and
  publishes, not only ``dp_size`` of them.
- **pipeline stages** (:func:`topology_problem`): only the ``pp_rank == 0`` scheduler
  of a DP rank answers ``get_internal_state`` and writes the load snapshot. On a
  disaggregated worker the other stages release their requests later: with the
  ``prefill_complete`` decode-allocation policy the "transfer done" notice to decode
  goes out from ``sender.clear()`` on each stage, so stage 0 can read idle (and
  ``rid_to_state`` be empty) while stage k has not yet notified decode; a decode stage
  likewise keeps its own deferred releases. Nothing the main process can read shows
  stage k, so ``pp_size > 1`` with role prefill or decode is UNKNOWN with that reason.
  Aggregated PP keeps every stage's work on stage 0's microbatch lists
  (``_pp_microbatches_drained`` in ``is_fully_idle``), and no remote reader holds KV.

Where SGLang is not importable (the core test environment), or its resolver is gone,
the raw fields are read instead.
"""

from __future__ import annotations

from typing import Any

from quiesce.probe import Role

_MISSING = object()


def resolved_arg(server_args: Any, name: str) -> Any:
    """SGLang's resolved value of ``name`` (module docstring), or the raw field; None if
    neither is there."""
    if server_args is None:
        return None
    try:
        from sglang.srt.arg_groups.overrides import (  # noqa: PLC0415 (optional engine)
            resolution_result,
        )
    except ImportError:
        return getattr(server_args, name, None)
    try:
        return resolution_result(server_args, name)
    except Exception:  # not a ServerArgs SGLang can resolve (a stand-in): the field
        return getattr(server_args, name, None)


def _width(server_args: Any, name: str, default: Any = _MISSING) -> int | None:
    value = resolved_arg(server_args, name)
    if value is None and default is not _MISSING:
        value = default
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 \
        else None


def dp_ranks_of(tokenizer_manager: Any) -> int | None:
    """How many DP ranks answer and publish (resolved ``dp_size * attn_dp_size``); None
    if either cannot be read. ``attn_dp_size`` absent (SGLang before it existed) is 1."""
    server_args = getattr(tokenizer_manager, "server_args", None)
    dp, attn_dp = _width(server_args, "dp_size"), _width(server_args, "attn_dp_size", 1)
    return None if dp is None or attn_dp is None else dp * attn_dp


def pp_size_of(tokenizer_manager: Any) -> int | None:
    """The resolved number of pipeline stages (absent: 1); None if unreadable."""
    return _width(getattr(tokenizer_manager, "server_args", None), "pp_size", 1)


def topology_problem(tokenizer_manager: Any, role: Role) -> str | None:
    """Why no signal can prove this worker idle (module docstring), or None."""
    pp = pp_size_of(tokenizer_manager)
    if pp is None:
        return "cannot read the number of pipeline stages (server_args.pp_size)"
    if pp > 1 and role is not Role.AGGREGATED:
        return (f"pipeline parallelism (pp_size={pp}) on a {role.value} worker: only "
                "pipeline stage 0 answers get_internal_state and writes the load "
                "snapshot, and a later stage can still owe decode its KV (it notifies "
                "decode from its own sender.clear()); quiesce cannot see it")
    return None
