"""Pure kernels (Triton, the cuDNN frontend, PyTorch's attention): FP8 row quantization (``quant``), fused
norms (``norm``), rotary codes (``rope``), FP8 attention (``fp8_attention``), the attention kernel chosen per
shape (``attention``) and variable-length attention (``varlen``). They import torch, triton and ``graphs``
only: no model library and no model family."""
