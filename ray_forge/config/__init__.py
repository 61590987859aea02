"""The job's config: the schema (frozen dataclasses, one per component) and its strict loader."""

from ray_forge.config.loader import ConfigError, from_dict, load_config, to_dict
from ray_forge.config.schema import check_engine_transport

__all__ = ["ConfigError", "check_engine_transport", "from_dict", "load_config", "to_dict"]
