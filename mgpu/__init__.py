"""mgpu: PyTorch DistributedDataParallel training as Slurm batch jobs that survive preemption.

This package's top level imports nothing heavy: the submission path must not import torch.
"""

__version__ = "0.1.0"
