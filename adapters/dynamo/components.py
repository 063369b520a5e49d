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
                  on_ready: Callable[[], Awaitable[None]] | None = None) -> DynamoComponent:
    """The component for ``dynamo.<name>``; :class:`ConfigError` for a name not in
    :data:`COMPONENTS`. Nothing of Dynamo is imported until ``install()``."""
    try:
        cls = COMPONENTS[name]
    except KeyError:
        raise ConfigError("component", f"unknown Dynamo component {name!r}; known: "
                          f"{', '.join(COMPONENTS)}") from None
    return cls(gate, on_ready)


__all__ = ["COMPONENTS", "ComponentControl", "DynamoComponent",
           "EngineProbe", "ModelRegistration", "SglangComponent", "TrtllmComponent",
           "VllmComponent", "component_for"]
