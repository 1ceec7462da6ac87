"""The digits data set (bundled with scikit-learn: no download) and the image-correctness oracle.

The oracle is an SVC fitted on the same stratified 80/20 split that trained the ``digits`` model;
it scores generated 8x8 images by whether it reads them as the digit that was asked for.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPLIT_SEED = 0


@lru_cache(maxsize=1)
def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test); x in [-1, 1] with shape (N, 8, 8)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.images.astype(np.float32) / 16.0) * 2.0 - 1.0  # (1797, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x, data.target, test_size=0.2, random_state=SPLIT_SEED, stratify=data.target)
    return x_train, y_train, x_test, y_test


@lru_cache(maxsize=1)
def classifier():
    """An SVC on the training split; ~99% on the held-out real digits."""
    from sklearn.svm import SVC

    x_train, y_train, _, _ = load_split()
    return SVC(gamma=0.02, C=10.0).fit(x_train.reshape(len(x_train), -1), y_train)


def classify(images: np.ndarray) -> np.ndarray:
    """Predicted digit for each image; images (N, 8, 8) or (N, 1, 8, 8) in [-1, 1]."""
    flat = np.clip(np.asarray(images, dtype=np.float32), -1, 1).reshape(len(images), -1)
    return classifier().predict(flat)


def oracle_accuracy(images: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of images the classifier reads as the label that was asked for."""
    return float(np.mean(classify(images) == np.asarray(labels)))


def sample_digits(engine, per_class: int, sampler: str, steps: int, guidance: float,
                  seed: int = 0, model: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Generate ``per_class`` images of each digit through ``engine``; (images (N, 8, 8) in [-1, 1], labels)."""
    from workers.request.spec import ItemSpec

    labels = np.repeat(np.arange(10), per_class)
    reqs = [ItemSpec(id=str(i), label=int(lb), seed=seed + i, sampler=sampler, steps=steps,
                         guidance=guidance, model=model) for i, lb in enumerate(labels)]
    results = engine.generate(reqs)
    images = np.stack([r.image.astype(np.float32) / 127.5 - 1.0 for r in results])  # uint8 -> [-1, 1]
    return images, labels
