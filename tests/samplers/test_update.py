"""The shared update: mixed batches, row independence, graph safety, guidance, padding rows."""
import pytest
import torch

from samplers import (
    COEFFS,
    NoiseSchedule,
    cfg_combine,
    gather_rows,
    hold_row,
    make_plan,
    model_input,
    sample,
    sampler_step,
)

FLOW = NoiseSchedule.from_config({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0})
REQUESTS = [  # sampler, steps, schedule, eta, guidance, the batch step at which it joins
    ("ddpm", 12, NoiseSchedule(), 0.0, 4.0, 0),
    ("ddim", 7, NoiseSchedule(clip_sample=True), 0.0, 1.0, 3),
    ("ddim", 9, NoiseSchedule(), 1.0, 1.5, 1),
    ("euler", 10, NoiseSchedule(timestep_spacing="linspace"), 0.0, 0.0, 2),
    ("euler_a", 5, NoiseSchedule(prediction_type="v_prediction"), 0.0, 7.5, 6),
    ("dpmpp_2m", 8, NoiseSchedule(prediction_type="v_prediction", timestep_spacing="trailing"), 0.0, 3.0, 0),
    ("flow_euler", 6, FLOW, 0.0, 2.0, 4),
]
SHAPE = (3, 4, 4)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def guided_model(labels: torch.Tensor, guidance: torch.Tensor):
    """A class-conditional fake network under classifier-free guidance; label 0 is the null class."""

    def net(x_in, t, y):
        t = t.view(-1, 1, 1, 1)
        return 0.5 * torch.tanh(x_in) + 0.1 * torch.cos(t / 300) + 0.2 * y.view(-1, 1, 1, 1) * torch.sin(x_in + t / 700)

    return lambda x_in, t: cfg_combine(net(x_in, t, labels), net(x_in, t, torch.zeros_like(labels)), guidance)


def test_mixed_batch_equals_one_by_one():
    """Samples of different samplers, step counts, guidance and start times in one batch (engine-style loop
    with gather_rows and hold rows) end exactly where each ends run alone."""
    plans = [make_plan(name, steps, sch, eta) for name, steps, sch, eta, _, _ in REQUESTS]
    starts = [r[5] for r in REQUESTS]
    labels = torch.arange(1.0, len(REQUESTS) + 1)
    guidance = torch.tensor([r[4] for r in REQUESTS])
    x_T = torch.stack([p.init_sigma * torch.randn(SHAPE, generator=_seeded(k)) for k, p in enumerate(plans)])

    alone = []
    for k, plan in enumerate(plans):
        gen = _seeded(100 + k)  # each request's own noise stream
        model = guided_model(labels[k : k + 1], guidance[k : k + 1])
        alone.append(sample(model, x_T[k : k + 1], plan, lambda x: torch.randn(x.shape, generator=gen))[0])

    gens = [_seeded(100 + k) for k in range(len(plans))]
    model = guided_model(labels, guidance)
    x, hist = x_T.clone(), torch.zeros_like(x_T)
    for j in range(max(s + p.num_steps for s, p in zip(starts, plans))):
        steps = [j - s if 0 <= j - s < p.num_steps else None for s, p in zip(starts, plans)]
        t, coeffs = gather_rows(plans, steps)
        out = model(model_input(x, coeffs), t)
        noise = torch.stack([
            torch.randn(SHAPE, generator=g) if i is not None and p.stochastic else torch.zeros(SHAPE)
            for g, i, p in zip(gens, steps, plans)
        ])  # fmt: skip
        x, hist = sampler_step(x, out, hist, noise, coeffs)

    assert (x - torch.stack(alone)).abs().max() <= 1e-6


def _random_inputs(batch=5, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    x, out, hist, noise = (torch.randn(batch, *SHAPE, generator=g) for _ in range(4))
    coeffs = torch.randn(batch, len(COEFFS), generator=g)
    coeffs[:, COEFFS.index("clip")] = torch.rand(batch, generator=g) + 0.5
    return x, out, hist, noise, coeffs


@pytest.mark.parametrize("row", [0, 2, 4])
def test_rows_are_independent(row):
    """Zeroing one sample's coefficients changes nothing in the other rows."""
    x, out, hist, noise, coeffs = _random_inputs()
    zeroed = coeffs.clone()
    zeroed[row] = 0.0
    others = [b for b in range(len(x)) if b != row]
    for a, b in zip(sampler_step(x, out, hist, noise, coeffs), sampler_step(x, out, hist, noise, zeroed)):
        assert torch.equal(a[others], b[others])
    assert torch.equal(model_input(x, coeffs)[others], model_input(x, zeroed)[others])


def test_sampler_step_is_the_documented_formula():
    x, out, hist, noise, coeffs = _random_inputs()
    c = {name: coeffs[:, k].view(-1, 1, 1, 1) for k, name in enumerate(COEFFS)}
    denoised = torch.maximum(torch.minimum(c["c_skip"] * x + c["c_out"] * out, c["clip"]), -c["clip"])
    x_next = c["c_x"] * x + c["c_e"] * out + c["c_d"] * denoised + c["c_h"] * hist + c["c_z"] * noise
    got_x, got_denoised = sampler_step(x, out, hist, noise, coeffs)
    torch.testing.assert_close(got_denoised, denoised)
    torch.testing.assert_close(got_x, x_next)
    torch.testing.assert_close(model_input(x, coeffs), c["c_in"] * x)


def test_update_needs_no_values():
    """Meta tensors have shapes but no data: an .item(), a host sync or a branch on values would raise."""
    meta = [torch.empty(4, *SHAPE, device="meta") for _ in range(4)]
    coeffs, g = torch.empty(4, len(COEFFS), device="meta"), torch.empty(4, device="meta")
    x_next, denoised = sampler_step(*meta, coeffs)
    assert x_next.shape == denoised.shape == (4, *SHAPE) and x_next.is_meta
    assert model_input(meta[0], coeffs).is_meta and cfg_combine(meta[0], meta[1], g).is_meta


def test_cfg_combine_per_sample():
    cond, uncond = torch.full((3, 2), 3.0), torch.full((3, 2), 1.0)
    guided = cfg_combine(cond, uncond, torch.tensor([1.0, 0.0, 4.0]))  # 1 + g * (3 - 1)
    assert guided[:, 0].tolist() == [3.0, 1.0, 9.0]


def test_hold_row_keeps_x_and_gather_rows_pads():
    plan = make_plan("ddim", 4, NoiseSchedule())
    t, coeffs = gather_rows([plan, plan, plan], [0, None, 3])
    assert t.tolist() == [750.0, 0.0, 0.0] and coeffs.shape == (3, len(COEFFS)) and coeffs.dtype == torch.float32
    assert torch.equal(coeffs[0], plan.coeffs[0]) and torch.equal(coeffs[1], hold_row())
    x, out, hist, noise, _ = _random_inputs(batch=3)
    x_next, _ = sampler_step(x, out, hist, noise, coeffs)
    assert torch.equal(x_next[1], x[1]) and torch.equal(model_input(x, coeffs)[1], x[1])


def test_sample_holds_finished_plans():
    """A batch of a 3-step and a 6-step plan: the short one stops after its own last step."""
    plans = [make_plan("euler", 3, NoiseSchedule()), make_plan("euler", 6, NoiseSchedule())]
    x_T = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(0)) * plans[0].init_sigma
    together = sample(guided_model(torch.ones(2), torch.ones(2)), x_T, plans)
    alone = sample(guided_model(torch.ones(1), torch.ones(1)), x_T[:1], plans[0])
    assert torch.equal(together[0], alone[0])


@pytest.mark.gpu
def test_one_captured_step_serves_every_sampler():
    """Capture model_input + guidance + sampler_step once in a CUDA graph; replaying it with the rows of a
    mixed batch copied into the static inputs matches the eager step bit for bit, step after step."""
    dev, batch = torch.device("cuda"), len(REQUESTS)
    plans = [make_plan(name, steps, sch, eta) for name, steps, sch, eta, _, _ in REQUESTS]
    labels = torch.arange(1.0, batch + 1, device=dev)
    x, hist, noise = (torch.zeros(batch, *SHAPE, device=dev) for _ in range(3))
    coeffs = torch.zeros(batch, len(COEFFS), device=dev)
    t, guidance = torch.zeros(batch, device=dev), torch.zeros(batch, device=dev)
    step = lambda: sampler_step(x, guided_model(labels, guidance)(model_input(x, coeffs), t), hist, noise, coeffs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream before capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_x_next, static_denoised = step()

    gen = torch.Generator(device=dev).manual_seed(0)
    live_x = torch.stack([p.init_sigma * torch.randn(SHAPE, device=dev, generator=gen) for p in plans])
    live_hist = torch.zeros_like(live_x)
    guidance.copy_(torch.tensor([r[4] for r in REQUESTS]))
    for j in range(max(p.num_steps for p in plans)):
        rows_t, rows = gather_rows(plans, [j if j < p.num_steps else None for p in plans])
        t.copy_(rows_t)
        coeffs.copy_(rows)
        x.copy_(live_x)
        hist.copy_(live_hist)
        noise.copy_(torch.randn(live_x.shape, device=dev, generator=gen))
        eager_x_next, eager_denoised = step()
        graph.replay()
        assert torch.equal(static_x_next, eager_x_next) and torch.equal(static_denoised, eager_denoised)
        live_x, live_hist = static_x_next.clone(), static_denoised.clone()  # the next replay overwrites them
    assert torch.isfinite(live_x).all()
