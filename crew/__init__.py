"""crew: train PyTorch models on many processes across many machines, DeepSpeed-compatible.

`import crew` stays light (no torch) so that the command line starts fast; the training API arrives
with the engine.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
