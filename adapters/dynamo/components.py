"""quiesce inside Dynamo's own worker components (ai-dynamo 1.6.1), picked by name.

``quiesce dynamo COMPONENT -- ARGS`` (:mod:`quiesce.serve.dynamo_worker`) runs Dynamo's real
``dynamo.COMPONENT`` worker in-process with quiesce's hooks:

- ``vllm`` — :class:`~.vllm_component.VllmComponent`
- ``sglang`` — :class:`~.sglang_component.SglangComponent`
- ``trtllm`` — :class:`~.trtllm_component.TrtllmComponent`

What they share (the shutdown recorder, the probe before and after the engine, the
model card, the control) is in :mod:`.component`; discovery (the model card, then the
endpoint instances) is :class:`~.model_card.ModelCardDiscovery`; what each hooks, in its
own module's docstring.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError

from .component import ComponentControl, DynamoComponent, EngineProbe, ModelRegistration
from .sglang_component import SglangComponent
from .trtllm_component import TrtllmComponent
from .vllm_component import VllmComponent

COMPONENTS: dict[str, type[DynamoComponent]] = {
    "vllm": VllmComponent, "sglang": SglangComponent, "trtllm": TrtllmComponent}
"""Dynamo worker components by the name ``python -m dynamo.<name>`` runs."""


def component_for(name: str, gate: AdmissionGate,
                  on_ready: Callable[[], Awaitable[None]] | None = None, *,
                  accept_untested_engine: str | None = None) -> DynamoComponent:
    """The component for ``dynamo.<name>``; :class:`ConfigError` for a name not in
    :data:`COMPONENTS`. Nothing of Dynamo is imported until ``install()``.

    ``accept_untested_engine``: the engine release the operator checked and accepts
    although quiesce's adapter was not tested on it (``sglang`` only; ConfigError
    otherwise, or when it does not name the installed release:
    :func:`quiesce.adapters.sglang.accept_untested`)."""
    try:
        cls = COMPONENTS[name]
    except KeyError:
        raise ConfigError("component", f"unknown Dynamo component {name!r}; known: "
                          f"{', '.join(COMPONENTS)}") from None
    if accept_untested_engine is None:
        return cls(gate, on_ready)
    if cls is not SglangComponent:
        raise ConfigError("accept_untested_engine", f"quiesce dynamo sglang only (the "
                          f"{name} probe has no untested release to accept)")
    return SglangComponent(gate, on_ready, accept_untested_engine=accept_untested_engine)


__all__ = ["COMPONENTS", "ComponentControl", "DynamoComponent",
           "EngineProbe", "ModelRegistration", "SglangComponent", "TrtllmComponent",
           "VllmComponent", "component_for"]
