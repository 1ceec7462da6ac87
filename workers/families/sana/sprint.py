"""Sana Sprint's step (the card is in ``workers.families.sana``; the rest of the runtime is Sana's): diffusers'
``SanaSprintPipeline`` over a SanaTransformer2DModel with ``guidance_embeds``, sampled by ``samplers.plans.scm``.

The transformer is a flow-matching network (x_tau = (1 - tau) x0 + tau z, velocity z - x0); the pipeline drives it as
the TrigFlow network F that SCMScheduler steps with, by SANA-Sprint's training-free transformation (Chen et al. 2025,
section 3.1). At the TrigFlow angle s of the row (the plan's model timestep), with x in units of sigma_data (the
scheduler's sample over sigma_data, ``samplers.plans.scm``):

    tau  = sin(s) / (cos(s) + sin(s))                       the flow time the network is given
    r    = sqrt(tau^2 + (1 - tau)^2)                        (= 1 / (cos(s) + sin(s)))
    x_in = r x                                              the flow sample: x_tau = x_s / (cos(s) + sin(s))
    F    = ((1 - 2 tau) x_in + (1 - 2 tau + 2 tau^2) v) / r the network's velocity v as TrigFlow's dx/ds

each line as the pipeline writes it, in float32 (the network in the model's dtype). The network is given tau itself
(the pipeline applies no ``timestep_scale``) and the embedded guidance, the row's scale cast to the prompt
embeddings' dtype times the transformer's ``guidance_embeds_scale`` (0.1), as the pipeline makes it. One forward
per image: no classifier-free guidance, no negative prompt. The prompt's embeddings and mask are Sana's (the same
instruction, tokenisation and Gemma-2 encoding; ``runtime``), the mask reaching the cross-attention as Sana's
per-head bias.
"""

from __future__ import annotations

import torch

from samplers import model_input, sampler_step
from samplers.schedules import SCM_INTERMEDIATE_TIMESTEP, SCM_MAX_TIMESTEP


def make_sprint_step(model, head_bias):
    """One whole Sana Sprint step: the TrigFlow angle to the flow time, the transformer with the row's embedded
    guidance, its velocity as TrigFlow's F, the sampler update (``scm``'s rows). ``head_bias``: the runtime's text
    mask -> per-head bias (``runtime.head_bias``)."""
    transformer, dtype = model.transformer, model.dtype
    c = model.latent_shape[0]
    heads = transformer.transformer_blocks[0].attn2.heads
    guidance_scale = float(transformer.config.guidance_embeds_scale)  # SanaSprintPipeline: guidance * this

    def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, prompt_mask):
        tau = torch.sin(t) / (torch.cos(t) + torch.sin(t))                              # (B,) flow time
        k = tau.view(-1, 1, 1, 1)
        xin = model_input(x, coeffs) * torch.sqrt(k**2 + (1 - k) ** 2)                 # (B, 32, h, w)
        v = transformer(xin.to(dtype), encoder_hidden_states=prompt_embeds,
                        encoder_attention_mask=head_bias(prompt_mask, heads, dtype),
                        guidance=guidance.to(prompt_embeds.dtype) * guidance_scale, timestep=tau,
                        return_dict=False)[0][:, :c]                                   # (B, 32, h, w)
        f = ((1 - 2 * k) * xin + (1 - 2 * k + 2 * k**2) * v) / torch.sqrt(k**2 + (1 - k) ** 2)
        x_next, denoised = sampler_step(x, f.float(), hist, noise, coeffs)
        return {"x_next": x_next, "hist_next": denoised}

    return step


def reference_pipeline(model):
    """SanaSprintPipeline over the model's modules (the DC-AE itself, not its adapter) with its card's SCMScheduler."""
    import diffusers as d

    pipe = d.SanaSprintPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae.vae,
                                transformer=model.transformer,
                                scheduler=d.SCMScheduler.from_config(model.card.scheduler))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_call(model, specs) -> dict:
    """SanaSprintPipeline's arguments for ``specs`` (one size and step count): its grid as ``scm`` runs it, the
    intermediate angle at 2 steps and none otherwise (the scheduler refuses one there)."""
    s = specs[0]
    w, h = (s.width, s.height) if s.width else model.card.native_size
    return dict(prompt=[x.prompt for x in specs], height=h, width=w, num_inference_steps=s.steps,
                guidance_scale=s.guidance, max_timesteps=SCM_MAX_TIMESTEP,
                intermediate_timesteps=SCM_INTERMEDIATE_TIMESTEP if s.steps == 2 else None,
                max_sequence_length=model.card.max_tokens, use_resolution_binning=False, clean_caption=False)
