"""Fixed-shape generators: GPipe, 1F1B, interleaved, ZB-H1/H2, ZB-V, DualPipeV, V-Min/V-Half."""

__all__: list[str] = []
