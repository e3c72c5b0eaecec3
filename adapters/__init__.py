"""PEFT LoRA adapters: the file format, validation against a base model, and residency
(host tier and device slots) for the engine."""

from adapters.cache import AdapterCache, AdapterCacheStats
from adapters.config import AdapterConfig
from adapters.errors import AdapterValidationError
from adapters.peft_format import LoraAdapter, LoraModule, load_adapter
from adapters.slots import LoraLayerWeights, SlotBuffers

__all__ = [
    "AdapterCache",
    "AdapterCacheStats",
    "AdapterConfig",
    "AdapterValidationError",
    "LoraAdapter",
    "LoraLayerWeights",
    "LoraModule",
    "SlotBuffers",
    "load_adapter",
]
