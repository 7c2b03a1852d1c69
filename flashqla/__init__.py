"""flashqla: Gated DeltaNet kernels for Hopper, re-derived step by step in Python and TileLang.

``flashqla.chunk_gated_delta_rule`` is a drop-in for FLA's function of the same name (fla-core
0.6.0's signature and keywords), ``flashqla.fused_recurrent_gated_delta_rule`` for FLA's decode
function; ``flashqla.integrations.fla.enable()`` makes FLA's own chunked function run ours. Importing this package never touches a GPU and never imports TileLang.
"""

from flashqla.api import chunk_gated_delta_rule
from flashqla.recurrent import fused_recurrent_gated_delta_rule

__version__ = "0.1.0"
__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "__version__"]
