"""dsv4: exact, fast inference for DeepSeek-V4.1-Flash and DeepSeek-V4-Flash.

    from dsv4 import Dsv4ForCausalLM
    model = Dsv4ForCausalLM.from_pretrained("path/or/repo-id", torch_dtype=torch.bfloat16)

Importing dsv4 registers `model_type: "dsv4"` with transformers' AutoConfig and AutoModelForCausalLM.
"""

from dsv4.config import ConfigError, Dsv4Config, LayerRole
from dsv4.engine.layout import cache_layout
from dsv4.hf import Dsv4ForCausalLM, register

register()

__version__ = "0.1.0"
__all__ = ["ConfigError", "Dsv4Config", "Dsv4ForCausalLM", "LayerRole", "__version__", "cache_layout"]
