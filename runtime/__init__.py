"""tandem runtime: config, models, speculation, orchestrator, client."""

from runtime.errors import EngineClosedError, EngineDeadError, EngineDrainingError, RequestError

__all__ = [
    "Engine",
    "Client",
    "EngineDeadError",
    "EngineClosedError",
    "EngineDrainingError",
    "RequestError",
    "GenerationOutput",
    "StreamDelta",
]


def __getattr__(name):  # lazy: importing runtime must not pull in torch for the client alone
    if name == "Engine":
        from runtime.api.engine import Engine

        return Engine
    if name == "Client":
        from runtime.api.client import Client

        return Client
    if name in ("GenerationOutput", "StreamDelta"):
        from runtime.api import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
