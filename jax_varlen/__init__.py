"""jax_varlen: variable-length attention for JAX that spends no compute on padding.

Public API: :func:`attention` (padded batch + ``nonpad_kv_seqlen``) and :func:`reference`
(the pure-JAX oracle of the same contract).
"""

from jax_varlen._api import attention
from jax_varlen.reference import reference

__version__ = "0.1.0"

__all__ = ["attention", "reference", "__version__"]
