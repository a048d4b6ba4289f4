"""Low-rank, compression and prototype attention: Linformer, Nystromformer, Synthesizer, Luna,
memory-compressed, Poolingformer, Long-Short, clustered, ProbSparse, low-rank + band, token
pooling.

Every public name here is also exported by ``xformers_jax.attention``.
"""

from ._clustered import clustered_attention as clustered_attention
from ._clustered import improved_clustered_attention as improved_clustered_attention
from ._linformer import init_linformer_projections as init_linformer_projections
from ._linformer import linformer_attention as linformer_attention
from ._long_short import init_long_short_projection as init_long_short_projection
from ._long_short import long_short_attention as long_short_attention
from ._lowrank_band import init_lowrank_band as init_lowrank_band
from ._lowrank_band import lowrank_band_attention as lowrank_band_attention
from ._luna import init_luna_sequence as init_luna_sequence
from ._luna import luna_attention as luna_attention
from ._memory_compressed import init_memory_compression as init_memory_compression
from ._memory_compressed import memory_compressed_attention as memory_compressed_attention
from ._nystrom import init_nystrom_conv as init_nystrom_conv
from ._nystrom import nystrom_attention as nystrom_attention
from ._poolingformer import poolingformer_attention as poolingformer_attention
from ._probsparse import probsparse_attention as probsparse_attention
from ._synthesizer import init_synthesizer as init_synthesizer
from ._synthesizer import synthesizer_attention as synthesizer_attention
from ._token_pooling import funnel_attention as funnel_attention
from ._token_pooling import funnel_pool as funnel_pool
from ._token_pooling import funnel_upsample as funnel_upsample
from ._token_pooling import init_token_learner as init_token_learner
from ._token_pooling import token_learner as token_learner
