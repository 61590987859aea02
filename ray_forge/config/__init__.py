"""The job's config: the schema (frozen dataclasses, one per component) and its strict loader."""

from ray_forge.config.loader import ConfigError, from_dict, load_config, to_dict

__all__ = ["ConfigError", "from_dict", "load_config", "to_dict"]
