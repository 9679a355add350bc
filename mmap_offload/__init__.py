"""mmap-offload: serve vLLM MoE experts from a repacked NVMe cache instead of pinned host RAM.

The public verbs (see README.md):

    from mmap_offload import warmup, open_cache, open_checkpoint, make_checkpoint
    warmup("ckpt/", "cache/", tp_size=2)          # build (or resume, or confirm) the cache
    cache = open_cache("cache/", tp_rank=0, tp_size=2)   # reads the manifest only
    cache.tensor(layer, expert, "w13_weight_packed")     # zero-copy view

Everything else is importable from its module (docs/ARCHITECTURE.md lists them in data-flow order).
"""

__version__ = "0.1.0"

__all__ = ["warmup", "open_cache", "open_checkpoint", "make_checkpoint", "__version__"]


def __getattr__(name):  # lazy: `import mmap_offload` stays cheap (vLLM loads the plugin in every process)
    if name == "warmup":
        from .warmup import warmup

        return warmup
    if name == "open_cache":
        from .cache_reader import open_cache

        return open_cache
    if name == "open_checkpoint":
        from .checkpoint import open_checkpoint

        return open_checkpoint
    if name == "make_checkpoint":
        from .synth import make_checkpoint

        return make_checkpoint
    raise AttributeError(name)
