"""The `cuda` tier runs on a CUDA machine (or rehearsed on CPU with PIPESCHED_DEVICE_TIER=cpu)
and skips, with the reason, everywhere else."""

import pytest

from tests.support.device_tier import tier_device_type


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if tier_device_type() is not None:
        return
    skip = pytest.mark.skip(reason="the cuda tier needs a CUDA device (torch.cuda.is_available() "
                                   "is False); PIPESCHED_DEVICE_TIER=cpu rehearses it on CPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
