"""dit-serve: batch image generation with diffusion transformers."""

__version__ = "0.1.0"
