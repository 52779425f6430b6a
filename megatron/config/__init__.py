"""Configuration: the schema, its flags and YAML form, and validation.

The bottom layer: it imports nothing else of ``megatron`` (validation may import the pure, stdlib-only
``megatron.pipeline_parallel.partition`` lazily, when a pipeline is configured; see docs/architecture.md).
A resumed run's saved configuration reaches ``parse_config`` as its ``base`` (``megatron.checkpoint.resume``).
"""

from megatron.config.cli import (
    ConfigError,
    Leaf,
    flatten_yaml,
    load_yaml,
    parse_config,
    save_yaml,
    set_value,
    to_dict,
    to_yaml,
)
from megatron.config.schema import Config
from megatron.config.validate import infer_tokenizer_type, validate

__all__ = ["Config", "ConfigError", "Leaf", "flatten_yaml", "load_yaml", "parse_config", "save_yaml", "set_value",
           "to_dict", "to_yaml", "validate", "infer_tokenizer_type"]
