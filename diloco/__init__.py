"""yeto-diloco: DiLoCo-style training across Megatron islands that meet through a central syncer."""
