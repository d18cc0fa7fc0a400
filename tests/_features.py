"""The feature table of the CPU attention tests (forward and backward): name -> keyword
arguments of cuattn.attention, drawn for a given (Sq, Sk)."""
import numpy as np

FEATURES = ["plain", "causal", "window", "causal_window", "softcap", "mask", "bias"]


def feature_kwargs(rng, name, sq, sk):
    """Keyword arguments for feature ``name``; masks and biases broadcast over a (2, 3)
    batch the NumPy way."""
    return {
        "plain": lambda: {},
        "causal": lambda: {"causal": True},
        "window": lambda: {"window": (7, 3)},
        "causal_window": lambda: {"causal": True, "window": (5, None)},
        "softcap": lambda: {"softcap": 2.0, "scale": 0.4},
        "mask": lambda: {"mask": rng.random((2, 1, sq, sk)) > 0.3},
        "bias": lambda: {"bias": rng.standard_normal((3, sq, sk)).astype(np.float32)},
    }[name]()


def seed(name):
    """A stable seed per feature (str hash() changes from process to process)."""
    return FEATURES.index(name)
