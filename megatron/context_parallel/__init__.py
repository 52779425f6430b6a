"""Context parallelism: a sequence split over ranks (``layout``: each rank's two chunks), how the ranks' keys and
values meet for attention (``attention``: ring, all-gather, all-to-all), and the recipe's step (``parallelize``).
The attention itself, on blocks, is ``megatron.attention``'s.

Import from the modules: this package imports nothing.
"""
