"""specdec: lossless speculative decoding and multi-token prediction in plain PyTorch."""
__version__ = "0.1.0"
