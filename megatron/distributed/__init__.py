"""Gradient buffers and (later) data-parallel gradient synchronisation."""
