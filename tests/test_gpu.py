"""CUDA tensors through the host staging path. Runs on a machine with a GPU (the lent
device machine); skipped cleanly where torch sees no CUDA device."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]


def test_cuda_tensor_put_and_get_into(client):
    t = torch.randn(256, 1024, device="cuda")
    client.put("gpu/a", t)
    out = torch.empty_like(t)
    assert client.get_into("gpu/a", out) == t.numel() * 4
    torch.cuda.synchronize()
    assert torch.equal(out, t)
    host = torch.empty(256, 1024)
    client.get_into("gpu/a", host)
    assert torch.equal(host, t.cpu())
