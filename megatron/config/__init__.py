"""Configuration: the schema, its flags and YAML form, and validation.

The bottom layer: it imports nothing else of ``megatron``. The layer-cutting rule of the pipeline lives here
(``layer_split``), so that validation and the model cut the layers the same way.
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
