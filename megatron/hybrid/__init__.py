"""Hybrid models' non-attention sequence mixers: the gated delta rule (Gated DeltaNet) and, later, Mamba-2."""
