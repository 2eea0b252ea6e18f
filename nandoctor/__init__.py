"""nandoctor: find the step, the tensor and the cause when a PyTorch run turns NaN."""

__version__ = "0.1.0"
__all__ = ["__version__"]
