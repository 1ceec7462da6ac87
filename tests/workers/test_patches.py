"""The attention break patch computes what diffusers' own attention computes."""

import torch

from workers.loading import load_model
from workers.patches import break_attention, restore_attention


def _forward(m, x, t, y):
    with torch.no_grad():
        return m.transformer(x, t, y).sample


def test_patched_attention_matches_diffusers_and_shares_one_scratch():
    m = load_model("digits")
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(6, 1, 8, 8, generator=g), torch.tensor([1, 50, 300, 700, 999, 10]), torch.arange(6)
    want = _forward(m, x, t, y)
    assert break_attention(m.transformer) == 4
    procs = [blk.attn1.processor for blk in m.transformer.transformer_blocks]
    assert len({id(p.scratch) for p in procs}) == 1  # one boundary allocation for all layers
    got = _forward(m, x, t, y)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    buf = procs[0].scratch.buffer
    _forward(m, x[:2], t[:2], y[:2])  # a smaller batch reuses the same allocation
    assert procs[0].scratch.buffer is buf
    restore_attention(m.transformer)
    assert torch.equal(_forward(m, x, t, y), want)
