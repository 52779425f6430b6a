"""NVIDIA Megatron-LM checkpoints <-> ours: ``commands`` (tools/convert_checkpoint.py's from-megatron and
to-megatron), ``convert`` (the tensors), ``core_names`` (Megatron Core's names and layouts), ``args`` (the saved args
Namespace), the two formats (``legacy``; ``dist`` through ``dcp_reader``), ``experts``, ``shards``, ``optim``,
``distrib_optim``, ``schedule`` and ``info`` (tools/checkpoint_info.py). Nothing is imported here."""
