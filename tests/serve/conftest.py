"""Serving tests share the machine with the worker processes they start: one torch thread here
(OpenMP threads spinning against busy workers on a small machine slow everything down many-fold)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


from tests.serve.hardened import hardened  # noqa: E402, F401 - the shared hardened 1P1D deployment
