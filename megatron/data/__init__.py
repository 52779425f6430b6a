"""Datasets, sampling and batching."""
