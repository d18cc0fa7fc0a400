"""cuattn: exact, fast attention for CuPy and NumPy.

``cuattn.attention(q, k, v)`` runs cuattn's own CUDA kernels on CuPy arrays and a blocked
NumPy implementation on NumPy arrays, with the same semantics (cuattn.reference).
"""
from .attention import attention, attention_backward, attention_vjp
from .cache import kv_cache_append
from .elementwise import vector_add
from .layers import multi_head_attention
from .merge import merge_attention

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "attention_vjp", "multi_head_attention",
           "merge_attention", "kv_cache_append", "vector_add", "__version__"]
