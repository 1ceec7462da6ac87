"""The update every sampler shares, classifier-free guidance, and a reference sampling loop.

Graph contract: model_input, cfg_combine and sampler_step are elementwise on device tensors of fixed shape:
no .item(), no host sync, no branch on values, no tensor made from host data, so a CUDA graph can capture
them. Everything per request arrives as a row of a (B, 9) coefficient tensor (see samplers.plans), so one
captured step serves samples of any sampler, at any step, with any step count and guidance.

Besides x, the caller keeps per sample:
  hist   the previous step's denoised (the multistep history). Start it at zeros, never at uninitialised
         memory: a first step multiplies it by c_h = 0, and 0 * NaN is NaN.
  noise  a fresh N(0, 1) draw per step when the plan is stochastic, else any finite tensor (zeros).
Keep x in float32: results are cast back to x's dtype, and bf16 latents would lose the update's precision.

gather_rows and sample run on the host; they are for the engine's bookkeeping, tests and the CPU path.
"""
from typing import Callable

import torch

from samplers.plans import C_D, C_E, C_H, C_IN, C_OUT, C_SKIP, C_X, C_Z, CLIP, COEFFS, Plan


def _col(coeffs: torch.Tensor, k: int, x: torch.Tensor) -> torch.Tensor:
    """Column k of (B, 9) coeffs as (B, 1, ..., 1), to broadcast over x's per-sample dims."""
    return coeffs[:, k].view(-1, *(1,) * (x.dim() - 1))


def model_input(x: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """What the network sees: c_in * x, (B, C, H, W)."""
    return (_col(coeffs, C_IN, x) * x).to(x.dtype)


def sampler_step(
    x: torch.Tensor, out: torch.Tensor, hist: torch.Tensor, noise: torch.Tensor, coeffs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of any sampler: returns (x_next, denoised); denoised is the next step's hist.

    denoised = clamp(c_skip x + c_out out, -clip, clip); x_next = c_x x + c_e out + c_d denoised + c_h hist + c_z noise.
    """
    clip = _col(coeffs, CLIP, x)
    denoised = (_col(coeffs, C_SKIP, x) * x + _col(coeffs, C_OUT, x) * out).clamp(-clip, clip)
    x_next = (
        _col(coeffs, C_X, x) * x
        + _col(coeffs, C_E, x) * out
        + _col(coeffs, C_D, x) * denoised
        + _col(coeffs, C_H, x) * hist
        + _col(coeffs, C_Z, x) * noise
    )
    return x_next.to(x.dtype), denoised.to(x.dtype)


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance (Ho & Salimans 2022): uncond + g (cond - uncond), g (B,) one per sample."""
    return uncond + guidance.view(-1, *(1,) * (cond.dim() - 1)) * (cond - uncond)


def hold_row() -> torch.Tensor:
    """A (9,) row that leaves x as it is (c_in 1, c_x 1, the rest 0): padding rows and finished samples."""
    row = torch.zeros(len(COEFFS))
    row[[C_IN, C_X]] = 1.0
    row[CLIP] = float("inf")
    return row


def gather_rows(plans: list[Plan], step_indices: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's model timesteps (B,) and coefficients (B, 9), on the CPU: plans[b] at step step_indices[b].

    An index of None gives a hold row (timestep 0): a padding slot or a sample that has finished.
    """
    hold = hold_row()
    rows = [hold if i is None else p.coeffs[i] for p, i in zip(plans, step_indices, strict=True)]
    ts = [torch.zeros(()) if i is None else p.timesteps[i] for p, i in zip(plans, step_indices)]
    return torch.stack(ts), torch.stack(rows)


def _rows(plans: Plan | list[Plan], i: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(plans, Plan):  # one plan for every row: broadcast instead of gathering B copies
        return plans.timesteps[i].expand(batch), plans.coeffs[i].expand(batch, len(COEFFS))
    return gather_rows(plans, [i if i < p.num_steps else None for p in plans])


def sample(
    model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    plans: list[Plan] | Plan,
    noise_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run plans to the end, k-diffusion style; returns x_0.

    model_fn(x_in (B, ...), t (B,)) -> out (guidance, if any, inside it). x is x_T = init_sigma * randn,
    one row per plan (a single Plan serves every row); shorter plans hold once done. noise_fn(x) gives each
    step's N(0, 1) noise (default torch.randn_like) and is called once per step, only if a plan is stochastic.
    """
    noise_fn = noise_fn or torch.randn_like
    many = plans if isinstance(plans, list) else [plans]
    stochastic = any(p.stochastic for p in many)
    hist = torch.zeros_like(x)
    for i in range(max(p.num_steps for p in many)):
        t, coeffs = (r.to(x.device) for r in _rows(plans, i, len(x)))
        out = model_fn(model_input(x, coeffs), t)
        noise = noise_fn(x) if stochastic else torch.zeros_like(x)
        x, hist = sampler_step(x, out, hist, noise, coeffs)
    return x
