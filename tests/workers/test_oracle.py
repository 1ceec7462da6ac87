"""The image-correctness oracle: generated digits must be read as the digit that was asked for."""

import pytest

from workers.config import WorkerConfig
from workers.models.digits import classify, load_split, oracle_accuracy, sample_digits
from workers.engine import Engine
from workers.loading import load_model

# (sampler, steps): each sampler at a step count it is meant for (ddim 50 has its own 200-image test)
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
def test_ddim_50_steps_200_digits(digits):
    """20 of each digit: all 200 read as asked (as do 500, which this test made until it was the suite's
    costliest); a model reading 85% of them would pass 0.90 here about once in 40 runs."""
    model, engine = digits
    images, labels = sample_digits(engine, 20, "ddim", 50, model.defaults["guidance"])
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
    """200 requests with different samplers, step counts and guidance, 128 at a time, joining as others
    finish: every image must still be the digit its own request asked for (all 200 are; 500 were too)."""
    import numpy as np

    from workers.request.spec import ItemSpec

    model, engine = digits
    mix = [("ddim", 25, 2.0), ("dpmpp_2m", 12, 2.5), ("euler", 20, 2.0), ("ddim", 15, 3.0)]
    labels = np.random.default_rng(0).integers(0, 10, 200)
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


# -- edits: image-to-image and inpainting on digits-text (workers.edits) ------------------------------------
# Sources are the classifier's held-out digits (the test split), as 8x8 grayscale PNGs; prompts are training-style
# and ask for another digit than the source's. Figures measured on a CPU (the model's defaults: dpmpp_2m, 20 steps,
# guidance 3), 360 sources / 111 inpaintings, source digit read | asked digit read:
#   strength 0.05: 97% | 1%    0.1: 84% | 8%    0.15: 44% | 41%    0.2: 14% | 76%    0.3: 1% | 97%    1.0: 0% | 99.7%
#   (at 0.3 with an empty prompt instead: 63% source; ddim and 50 steps alike: 1-20% source)
#   inpainting a 3 with "an eight": its left half repainted 99.1% read 8; its right half 12.6% (83.8% stay a 3).
# The model's schedule is DDPM's linear betas on 8x8 pixels: strength 0.3 starts at t = 300, x = 0.63 x0 + 0.78 eps,
# from which even the Bayes-optimal reading names the source's digit on 72% (a test below). And a 3's right half
# already is an 8's: repainting it leaves the 3's open left side, and no right half of a real 8 joined to it is read
# as an 8 for more than 65% of the threes (a test below). The two figures that cannot hold for this model are
# kept as strict xfails with these numbers, beside the ones that do and the two tests that show why.
def _png(x) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.round((np.clip(x, -1, 1) + 1) * 127.5).astype(np.uint8), "L").save(out, "PNG")
    return out.getvalue()


def _half_mask(left: bool) -> bytes:
    import numpy as np

    m = np.full((8, 8), -1.0)  # black: kept
    m[:, slice(0, 4) if left else slice(4, 8)] = 1.0  # white: repainted
    return _png(m)


@pytest.fixture(scope="module")
def digits_text():
    model = load_model("digits-text")
    return model, Engine(model, WorkerConfig(backend="eager", max_batch=64))


def _image_to_image(digits_text, strength: float, count: int = 100):
    """(digits read, source digits, asked digits) for ``count`` held-out sources with prompts asking another digit."""
    import random

    import numpy as np

    from workers.models.train_digits_text import training_prompts
    from workers.request.spec import ItemSpec

    model, engine = digits_text
    _, _, x_test, y_test = load_split()
    rng = random.Random(0)
    source = y_test[:count]
    asked = np.array([(int(d) + rng.randint(1, 9)) % 10 for d in source])
    d = model.defaults
    specs = [ItemSpec(id=str(i), seed=1000 + i, sampler=d["sampler"], steps=d["steps"], guidance=d["guidance"],
                      prompt=rng.choice(training_prompts(int(a))), image=_png(x_test[i]), strength=strength)
             for i, a in enumerate(asked)]
    results = engine.generate(specs, max_active=64)
    return classify(np.stack([r.latents[0].numpy() for r in results])), source, asked


def test_image_to_image_at_strength_1_draws_the_prompts_digit(digits_text):
    read, source, asked = _image_to_image(digits_text, 1.0, count=60)
    assert (read == asked).mean() >= 0.90, f"asked digit read on {(read == asked).mean():.3f}"


def test_image_to_image_at_a_low_strength_keeps_the_source_digit(digits_text):
    read, source, asked = _image_to_image(digits_text, 0.05)  # one step, from t = 50
    assert (read == source).mean() >= 0.90, f"source digit read on {(read == source).mean():.3f}"


def test_at_strength_0_3_the_noised_source_no_longer_tells_its_digit_on_90_percent():
    """Why the strength-0.3 figure cannot hold for digits-text: image-to-image starts from the source noised to
    t = 300 of the model's schedule (DDPM's linear betas, PixArt's own), x = 0.63 x0 + 0.78 eps on 8x8 pixels. The
    Bayes-optimal reading of that start (the posterior over digits with the training set as the prior) names the
    source's digit on 71.7% of the 360 held-out digits, so no sampler from that start keeps it on 90% even with an empty
    prompt (ours: 63%); from t = 50 (strength 0.05, which the test above holds to 90%) on 98.6%."""
    import numpy as np

    x_train, y_train, x_test, y_test = load_split()
    betas = np.linspace(1e-4, 0.02, 1000)  # the scheduler's config: linear, 1e-4..0.02, 1000 steps
    alpha_bar = np.cumprod(1 - betas)
    rng = np.random.default_rng(0)

    def bayes_keeps_the_digit(t: int) -> float:
        a, s = alpha_bar[t] ** 0.5, (1 - alpha_bar[t]) ** 0.5
        xt = (a * x_test + s * rng.standard_normal(x_test.shape)).reshape(len(x_test), -1)
        log_like = -((xt[:, None] - a * x_train.reshape(1, len(x_train), -1)) ** 2).sum(-1) / (2 * s * s)
        weights = np.exp(log_like - log_like.max(1, keepdims=True))  # (test, train)
        posterior = np.stack([weights[:, y_train == d].sum(1) for d in range(10)], 1)
        return float((posterior.argmax(1) == y_test).mean())

    at_300, at_50 = bayes_keeps_the_digit(300), bayes_keeps_the_digit(50)
    assert at_300 < 0.80 and at_50 > 0.95, (at_300, at_50)


@pytest.mark.xfail(strict=True, reason="issue 47's figure does not hold for digits-text: at strength 0.3 (t = 300 "
                   "of its linear-beta schedule) 1% keep the source digit and 97% draw the prompt's (see above)")
def test_image_to_image_at_strength_0_3_keeps_the_source_digit(digits_text):
    read, source, asked = _image_to_image(digits_text, 0.3, count=50)
    assert (read == source).mean() >= 0.90, f"source digit read on {(read == source).mean():.3f}"


def _inpaint_threes(digits_text, left: bool, seeds: int):
    """Each held-out 3 (37) with one half repainted from "an eight", ``seeds`` seeds each: (digits read, the sources,
    the final pixels)."""
    import numpy as np

    from workers.request.spec import ItemSpec

    model, engine = digits_text
    _, _, x_test, y_test = load_split()
    threes = x_test[y_test == 3]
    d = model.defaults
    specs = [ItemSpec(id=str(i), seed=2000 + i, sampler=d["sampler"], steps=d["steps"], guidance=d["guidance"],
                      prompt="an eight", image=_png(threes[i % len(threes)]), mask=_half_mask(left))
             for i in range(seeds * len(threes))]
    pixels = np.stack([r.latents[0].numpy() for r in engine.generate(specs, max_active=64)])
    sources = np.stack([threes[i % len(threes)] for i in range(len(specs))])
    return classify(pixels), sources, pixels


def test_inpainting_the_left_half_of_a_3_with_an_eight_draws_an_8(digits_text):
    import numpy as np

    read, sources, pixels = _inpaint_threes(digits_text, left=True, seeds=2)
    assert (read == 8).mean() >= 0.90, f"8 read on {(read == 8).mean():.3f}"
    kept = np.round((np.clip(sources, -1, 1) + 1) * 127.5) / 127.5 - 1  # the PNG's pixels
    assert np.abs(pixels[:, :, 4:] - kept[:, :, 4:]).max() < 1e-5  # the kept half is the source's, exactly


def test_no_inpainting_that_keeps_a_3s_left_half_is_read_as_an_8_on_70_percent():
    """Why the right-half figure cannot hold for any inpainter that keeps the pixels outside the mask (as diffusers'
    inpaint pipelines do, and ours): each held-out 3's left half joined to the right half of every real 8 (training
    and held-out, 182) is read as an 8 on 8.3% of the pairs, and even the best of those 8s for each 3 gives an 8 for
    only 24 of the 37 threes (64.9%). The left half, the one that differs, joined the same way: 82.6% and 37 of 37."""
    import numpy as np

    x_train, y_train, x_test, y_test = load_split()
    threes = x_test[y_test == 3]
    eights = np.concatenate([x_train[y_train == 8], x_test[y_test == 8]])

    def read_as_8(repainted: slice) -> np.ndarray:  # (threes, eights): the pair is read as an 8
        joined = np.repeat(threes[:, None], len(eights), 1)  # (37, 182, 8, 8)
        joined[:, :, :, repainted] = eights[None, :, :, repainted]
        return (classify(joined.reshape(-1, 8, 8)) == 8).reshape(len(threes), len(eights))

    right, left = read_as_8(slice(4, 8)), read_as_8(slice(0, 4))
    assert right.any(axis=1).mean() < 0.70 and right.mean() < 0.15, (right.any(axis=1).mean(), right.mean())
    assert left.any(axis=1).mean() == 1.0 and left.mean() > 0.75, (left.any(axis=1).mean(), left.mean())


@pytest.mark.xfail(strict=True, reason="issue 47's figure does not hold: repainting the right half of a 3 from "
                   "\"an eight\" gives an 8 on 12.6% (83.8% stay a 3: a 3's right half is an 8's; see the test above)")
def test_inpainting_the_right_half_of_a_3_with_an_eight_draws_an_8(digits_text):
    read, _, _ = _inpaint_threes(digits_text, left=False, seeds=1)
    assert (read == 8).mean() >= 0.70, f"8 read on {(read == 8).mean():.3f}"
