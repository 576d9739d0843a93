"""lightning-lazytrain: train models larger than GPU memory from PyTorch Lightning."""

__version__ = "0.1.0"
