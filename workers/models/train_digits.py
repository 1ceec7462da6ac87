"""Train the embedded ``digits`` model: a tiny class-conditional DiT on scikit-learn's 8x8 digits.

Reproducible recipe (seeded): the digits data set ships inside scikit-learn (no download); the
same stratified 80/20 split (``workers.models.digits.split``) trains this model and the oracle classifier.
Pixels 0..16 map to [-1, 1]. Two objectives: ``eps`` (the ``digits`` model): epsilon-prediction
with DDPM linear betas (1e-4..0.02, 1000 steps) as DiT uses; ``flow`` (``digits-flow``): rectified
flow, x_s = (1 - s) x0 + s eps, predicting the velocity eps - x0 at timestep 1000 s. The label embedding drops 10% of labels to the null class (index 10) for
classifier-free guidance. AdamW with warm-up and cosine decay; an EMA of the weights is saved.

    python -m workers.models.train_digits --out workers/models/digits --steps 6000
    python -m workers.models.train_digits --objective flow --out workers/models/digits-flow

Runs on CUDA when present, else on the CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import save_file

from workers.models.digits import DIGIT_NAMES, load_split

log = logging.getLogger(__name__)

ARCH = dict(
    num_attention_heads=4, attention_head_dim=32, in_channels=1, out_channels=1, num_layers=4,
    sample_size=8, patch_size=2, num_embeds_ada_norm=10, dropout=0.0, norm_type="ada_norm_zero",
)
SCHEDULER = {
    "_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_start": 0.0001,
    "beta_end": 0.02, "beta_schedule": "linear", "prediction_type": "epsilon",
    "clip_sample": False, "set_alpha_to_one": True, "steps_offset": 0, "timestep_spacing": "leading",
}
FLOW_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0}
DEFAULTS = {"eps": {"guidance": 2.0, "sampler": "ddim", "steps": 50},
            "flow": {"guidance": 2.0, "sampler": "flow_euler", "steps": 30}}


def noised(x0, eps, t, abar, objective: str):
    """(x_t, target) for a batch: the forward process and what the network learns to predict."""
    if objective == "flow":
        s = (t / 1000).view(-1, 1, 1, 1)
        return (1 - s) * x0 + s * eps, eps - x0      # rectified flow: velocity dx/ds
    a = abar[t].view(-1, 1, 1, 1)
    return a.sqrt() * x0 + (1 - a).sqrt() * eps, eps  # q(x_t | x_0), epsilon target


def train(steps: int, batch: int, lr: float, seed: int, device: str,
          objective: str = "eps") -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    x_train, y_train, _, _ = load_split()
    x = torch.as_tensor(x_train, dtype=torch.float32).view(-1, 1, 8, 8).to(device)  # (N, 1, 8, 8)
    y = torch.as_tensor(y_train, dtype=torch.long).to(device)
    betas = torch.linspace(SCHEDULER["beta_start"], SCHEDULER["beta_end"], 1000, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0).float().to(device)  # (1000,)
    model = DiTTransformer2DModel(**ARCH).to(device).train()
    ema = DiTTransformer2DModel(**ARCH).to(device).eval().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator(device=device).manual_seed(seed)
    t0 = time.time()
    for step in range(steps):
        idx = torch.randint(0, len(x), (batch,), device=device, generator=gen)
        x0, labels = x[idx], y[idx]
        if objective == "flow":  # continuous s in [0, 1], fed as the timestep 1000 s
            t = torch.rand(batch, device=device, generator=gen) * 1000
        else:
            t = torch.randint(0, 1000, (batch,), device=device, generator=gen)
        eps = torch.randn(x0.shape, device=device, generator=gen)
        xt, target = noised(x0, eps, t, abar, objective)
        loss = torch.nn.functional.mse_loss(model(xt, t, labels).sample, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            decay = min(0.999, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        if step % 500 == 0 or step == steps - 1:
            log.info("step %d loss %.4f (%.0f s)", step, loss.item(), time.time() - t0)
    info = {"objective": objective, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "device": device,
            "train_seconds": round(time.time() - t0, 1), "final_loss": round(loss.item(), 5)}
    return ema, info


def save(model: torch.nn.Module, out: Path, info: dict) -> None:
    objective = info["objective"]
    sched = FLOW_SCHEDULER if objective == "flow" else SCHEDULER
    (out / "transformer").mkdir(parents=True, exist_ok=True)
    (out / "scheduler").mkdir(parents=True, exist_ok=True)
    config = {"_class_name": "DiTTransformer2DModel", **ARCH}
    (out / "transformer" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # fp16 on disk keeps the directory small; loading upcasts to the serving dtype
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched, indent=2) + "\n")
    index = {
        "_class_name": "DiTPipeline",
        "transformer": ["diffusers", "DiTTransformer2DModel"],
        "scheduler": ["diffusers", sched["_class_name"]],
        "id2label": {str(i): name for i, name in enumerate(DIGIT_NAMES)},
        "dit_serve": {"defaults": DEFAULTS[objective], "pixel_space": True, "training": info},
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "digits")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--objective", choices=["eps", "flow"], default="eps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model, info = train(args.steps, args.batch, args.lr, args.seed, args.device, args.objective)
    save(model, args.out, info)
    log.info("saved %s: %s", args.out, info)


if __name__ == "__main__":
    main()
