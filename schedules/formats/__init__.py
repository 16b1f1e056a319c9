"""Schedule text formats of other projects: torch.distributed.pipelining's CSV."""

__all__: list[str] = []
