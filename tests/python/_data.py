"""The arrays the Python test scripts reduce: rank r's, values that differ by rank and
element (integers exact)."""
import numpy as np


def data(r, n, dtype):
    """Rank r's array of n elements of dtype."""
    x = (np.arange(n, dtype=np.int64) * 7 + r * 13) % 101 - 50
    if np.issubdtype(dtype, np.floating):
        return (x * 0.37 + r * 0.11).astype(dtype)
    return x.astype(dtype)
