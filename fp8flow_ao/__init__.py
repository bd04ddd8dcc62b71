"""fp8flow_ao: FP8-Flow-MoE training for PyTorch MoE models on Hopper GPUs."""

from fp8flow_ao._format import AMAX_EPS, BLOCK, FP8_DTYPE, FP8_MAX

__all__ = ["AMAX_EPS", "BLOCK", "FP8_DTYPE", "FP8_MAX"]
__version__ = "0.1.0"
