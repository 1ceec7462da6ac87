"""The GELU epilogue on a GPU: cuBLASLt's bias + tanh-GELU epilogue is what diffusers computes, within bf16
rounding, for one product and for every family's transformer (tiny random models in the real layouts, bf16).

Tolerance: the epilogue applies GELU to the float32 accumulator and rounds once, diffusers rounds the
product to bf16 and then the GELU's result: one product differs by at most two bf16 roundings (2^-7 of
its largest value). Through a tiny transformer (two to four blocks, the residual stream carrying the
differences) asserted: 2% of the largest output; a wrong epilogue (erf form, a dropped bias, the wrong
weight block in FLUX's split ``proj_out``) is off by far more.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.speed.test_epilogues import _forward, _fuse_all, tiny_dirs  # noqa: F401 (a fixture)
from workers.speed.epilogues import GeluEpilogue, epilogue_ok, linear_gelu
from workers.loading import load_model

pytestmark = pytest.mark.gpu


def test_the_cuda_epilogue_is_tanh_gelu_and_close_to_diffusers():
    assert epilogue_ok("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    proj = torch.nn.Linear(256, 1024, device="cuda", dtype=torch.bfloat16)
    exact = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), proj.weight.float(), proj.bias.float()),
                                     approximate="tanh")
    got = linear_gelu(x, proj, epilogue=True)
    eager = linear_gelu(x, proj, epilogue=False)
    scale = exact.abs().max().item()
    assert (got.float() - exact).abs().max().item() <= 2 ** -8 * scale   # one rounding
    assert (got.float() - eager.float()).abs().max().item() <= 2 ** -7 * scale


@pytest.mark.parametrize("family", ["dit", "pixart", "sd3", "flux"])
def test_patched_transformers_compute_what_diffusers_computes(family, tiny_dirs):  # noqa: F811
    spec = "digits" if family == "dit" else tiny_dirs[family]
    model = load_model(spec, device="cuda", dtype=torch.bfloat16)
    want = _forward(model, family).float()
    assert _fuse_all(model.transformer) > 0
    assert all(m.epilogue for m in model.transformer.modules() if type(m) is GeluEpilogue)
    got = _forward(model, family).float()
    err = (got - want).abs().max().item()
    assert 0 < err <= 0.02 * want.abs().max().item()  # > 0: the epilogue ran (it rounds differently)
