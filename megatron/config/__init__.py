"""Configuration: the schema, its flags and YAML form, and validation."""

from megatron.config.cli import ConfigError, parse_config, save_yaml, to_dict, to_yaml
from megatron.config.schema import Config
from megatron.config.validate import validate

__all__ = ["Config", "ConfigError", "parse_config", "save_yaml", "to_dict", "to_yaml", "validate"]
