"""Hugging Face checkpoints <-> ours: ``mapping`` (the engine: a family is one ``Family`` value, a table of names
with ``{}`` placeholders read both ways), ``transforms`` (the named tensor transforms the families share),
``common`` (ConversionError, the vocabulary, the tokenizer files), ``config_checks`` (a ``config.json`` read as
transformers reads it, before any mapping), ``models`` (which family converts a model) and one module per family:
``gpt2``, ``llama``, ``qwen3``, ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v3``, ``gpt_oss``. Nothing is
imported here: a family is imported by name."""
