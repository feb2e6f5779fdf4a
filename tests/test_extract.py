"""Host staging of a trained model (the CUDA path is checked by bench/gpu_site_round.py)."""

from __future__ import annotations

import torch

from fedra.client.parallel.extract import HostStager, _layout


def test_cpu_tensors_are_returned_detached_without_a_copy() -> None:
    weight = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    state = {"a": weight, "b": torch.tensor([1, 2], dtype=torch.int64)}
    out = HostStager().to_host(state)
    for k, v in state.items():
        assert torch.equal(out[k], v) and out[k].dtype == v.dtype
        assert out[k].data_ptr() == v.data_ptr()  # no pass over the model
        assert not out[k].requires_grad


def test_layout_aligns_every_tensor_to_64_bytes() -> None:
    state = {
        "x": torch.zeros(3, dtype=torch.float16),  # 6 bytes
        "y": torch.zeros(5, dtype=torch.float64),  # 40 bytes
        "z": torch.zeros(0),
    }
    offsets, total = _layout(state)
    assert offsets == {"x": 0, "y": 64, "z": 128}
    assert total == 128
    assert all(o % 64 == 0 for o in offsets.values())
