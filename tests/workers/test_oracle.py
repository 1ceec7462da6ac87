"""The image-correctness oracle: generated digits must be read as the digit that was asked for."""

import pytest

from workers.config import WorkerConfig
from workers.models.digits import classify, load_split, oracle_accuracy, sample_digits
from workers.engine import Engine
from workers.loading import load_model

# (sampler, steps): each sampler at a step count it is meant for (ddim 50 has its own 500-image test)
SAMPLERS = [("ddpm", 100), ("ddim", 10), ("euler", 50), ("euler_a", 50), ("dpmpp_2m", 20)]


@pytest.fixture(scope="module")
def digits():
    model = load_model("digits")
    return model, Engine(model, WorkerConfig(backend="eager", max_batch=64))


def test_classifier_reads_real_digits():
    _, _, x_test, y_test = load_split()
    assert oracle_accuracy(x_test, y_test) >= 0.98


def test_classifier_rejects_noise():
    import numpy as np
    noise = np.random.default_rng(0).uniform(-1, 1, (200, 8, 8))
    # pure noise is not a recognisable digit: it does not land on the label we would ask for
    assert oracle_accuracy(noise, np.repeat(np.arange(10), 20)) < 0.3


@pytest.mark.slow
def test_ddim_50_steps_500_digits(digits):
    model, engine = digits
    images, labels = sample_digits(engine, 50, "ddim", 50, model.defaults["guidance"])
    acc = oracle_accuracy(images, labels)
    assert acc >= 0.90, f"oracle accuracy {acc:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("sampler, steps", SAMPLERS)
def test_every_sampler_makes_digits(digits, sampler, steps):
    model, engine = digits
    images, labels = sample_digits(engine, 10, sampler, steps, model.defaults["guidance"], seed=1000)
    acc = oracle_accuracy(images, labels)
    assert acc >= 0.85, f"{sampler} {steps} steps: oracle accuracy {acc:.3f}"


@pytest.mark.slow
def test_flow_euler_on_the_flow_model():
    model = load_model("digits-flow")
    engine = Engine(model, WorkerConfig(backend="eager", max_batch=64))
    images, labels = sample_digits(engine, 20, "flow_euler", model.defaults["steps"], model.defaults["guidance"])
    acc = oracle_accuracy(images, labels)
    assert acc >= 0.85, f"flow_euler: oracle accuracy {acc:.3f}"


def test_labels_are_not_ignored(digits):
    """Asking for 3s yields 3s, not the model's favourite digit."""
    model, engine = digits
    images, _ = sample_digits(engine, 3, "ddim", 20, model.defaults["guidance"])
    assert len(set(classify(images).tolist())) >= 8


@pytest.mark.slow
def test_mixed_staggered_batch_keeps_labels_apart(digits):
    """500 requests with different samplers, step counts and guidance, joining as others finish:
    every image must still be the digit its own request asked for."""
    import numpy as np

    from workers.request.spec import ItemSpec

    model, engine = digits
    mix = [("ddim", 25, 2.0), ("dpmpp_2m", 12, 2.5), ("euler", 20, 2.0), ("ddim", 15, 3.0)]
    labels = np.random.default_rng(0).integers(0, 10, 500)
    reqs = [ItemSpec(id=str(i), label=int(lb), seed=5000 + i, sampler=mix[i % 4][0], steps=mix[i % 4][1],
                         guidance=mix[i % 4][2]) for i, lb in enumerate(labels)]
    results = engine.generate(reqs, max_active=128)  # staggered: new requests join at step boundaries
    images = np.stack([r.image.astype(np.float32) / 127.5 - 1.0 for r in results])
    assert [r.request.id for r in results] == [r.id for r in reqs]
    acc = oracle_accuracy(images, labels)
    assert acc >= 0.90, f"oracle accuracy {acc:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("held_out, target", [(False, 0.90), (True, 0.80)])
def test_digits_text_through_our_engine_draws_the_asked_digit(held_out, target):
    """The shipped text model through our engine (its card, loader, text path; not diffusers' pipeline):
    100 images from training-style prompts, or from phrasings held out of training."""
    import numpy as np

    from workers.models.train_digits_text import oracle_prompts
    from workers.request.spec import ItemSpec

    model = load_model("digits-text")
    prompts, labels = oracle_prompts(10, held_out, seed=7)
    d = model.defaults
    specs = [ItemSpec(id=str(i), seed=9000 + i, sampler=d["sampler"], steps=d["steps"], guidance=d["guidance"],
                      prompt=p) for i, p in enumerate(prompts)]
    results = Engine(model, WorkerConfig(backend="eager", max_batch=64)).generate(specs, max_active=64)
    images = np.stack([r.latents[0].numpy() for r in results])  # pixel space: (8, 8) in [-1, 1]
    acc = oracle_accuracy(images, labels)
    assert acc >= target, f"oracle accuracy {acc:.3f} ({'held-out' if held_out else 'training-style'} prompts)"
