"""Gradient buffers, data-parallel gradient synchronisation (all-reduce or reduce-scatter, overlapped
with the backward), ZeRO sharding stages 1-3, and the cross-rank gradient sums before the step."""
