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


def test_cuda_segment_node_end_to_end(make_cluster):
    """A store node with a GPU segment (--device cuda:0): puts and gets of host and CUDA
    tensors go through its pinned staging buffer, over the Unix socket on this host and
    over TCP when forced; the node reports its device."""
    lc = make_cluster(nodes=0)
    lc.start_node("gpu-node", "256MiB", device="cuda:0")
    lc.wait_nodes(1)
    with lc.client() as c:
        assert c.stats().nodes[0].device == "cuda:0"
        t = torch.randn(1024, 1024, device="cuda")  # 4 MiB: one staged piece
        big = torch.randn(3, 1024, 1024)  # 12 MiB from host memory: three pieces
        assert c.put("gpuseg/t", t) is True
        assert c.put("gpuseg/big", big) is True
        out = torch.empty_like(t)
        assert c.get_into("gpuseg/t", out) == t.numel() * 4
        torch.cuda.synchronize()
        assert torch.equal(out, t)
        back = torch.empty_like(big)
        assert c.get_into("gpuseg/big", back) == big.numel() * 4 and torch.equal(back, big)
    with lc.client(transport="tcp") as c:
        assert c.get("gpuseg/big") == big.numpy().tobytes()
