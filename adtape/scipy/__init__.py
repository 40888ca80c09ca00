"""SciPy's functions for Tensors, recorded: ``adtape.scipy.special`` (as ``autograd.scipy``)."""
from adtape.scipy import special

__all__ = ["special"]
