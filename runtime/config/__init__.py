"""The tandem config: `load_config` (YAML or a dict -> a validated, frozen TandemConfig), its
schema, and the checks that look beyond its own values (files, devices, KV memory)."""

from runtime.config.load import load_config
from runtime.config.schema import (
    ConfigError,
    Device,
    ModelConfig,
    RuntimeConfig,
    ServerConfig,
    SpeculationConfig,
    TandemConfig,
    default_config,
    default_model_path,
    parse_device,
)

__all__ = [
    "ConfigError",
    "Device",
    "ModelConfig",
    "SpeculationConfig",
    "RuntimeConfig",
    "ServerConfig",
    "TandemConfig",
    "load_config",
    "parse_device",
    "default_config",
    "default_model_path",
]
