"""Host compute of experts straight from the cache's bytes (issue 15): ``kernel.HostKernel`` runs W4A16
expert MLPs on the Marlin words as the cache maps them (csrc/host_kernel.c, loaded by ``native``)."""

from .kernel import HostKernel, available_isas, dequantize_marlin

__all__ = ["HostKernel", "available_isas", "dequantize_marlin"]
