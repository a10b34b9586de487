"""The forward pass: one run of the model over the corpus, with hooks that collect Q, K and V.

Forward hooks on each selected layer's ``q_proj``/``k_proj``/``v_proj`` (``q_norm``/``k_norm`` where the
model normalizes before RoPE) collect the pre-RoPE activations, a hook on the shared rotary embedding
collects ``cos``/``sin`` (one table per layer type where the model has several, e.g. Gemma 3's local and
global RoPE), and the post-RoPE keys and the values are read from a plain ``DynamicCache`` given to the
model (every token of every layer kept, sliding-window layers included) — the model and its attention are
left as they are. With gradients, the K and V activations are replaced by leaves so that the backward
pass of the LM loss keeps their gradients; the loss is computed from the final hidden states a block of
positions at a time (:func:`lm_logits`), so a large vocabulary never makes a ``(seq_len, vocab)`` array.
The backward pass holds one decoder layer's graph at a time (:func:`_forward_backward`): the forward keeps
each layer's input, and the backward runs each layer's forward again from it, last layer first — the same
operations on the same values, so the same gradients as one backward pass through the whole model (tested)
in a fraction of its memory.

The RoPE tables are stored per selected layer (``cos``/``sin`` of shape ``(layers, seq_len, head_dim)``): a
model with one table per layer type gives each layer its type's, so ``apply_rope(k_pre, cos, sin)`` is the
cached key of every layer and ``k_pre`` is the model's own pre-RoPE key everywhere.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from kvqbench.data.capture.loading import _model_for_capture
from kvqbench.data.capture.models import _ModelRef, _torch_dtype
from kvqbench.data.corpus import corpus_sha256, corpus_text
from kvqbench.data.memory import release_freed
from kvqbench.data.types import KVData, apply_rope


def _layer_spec(layers: Any) -> Any:
    """JSON-able form of the ``layers`` argument (validated for type), used in disk-cache keys."""
    if layers is None:
        return "all"
    if isinstance(layers, slice):
        for part in (layers.start, layers.stop, layers.step):
            if part is not None and (not isinstance(part, int) or isinstance(part, bool)):
                raise TypeError(f"layers slice bounds must be ints or None, got {layers!r}")
        return {"slice": [layers.start, layers.stop, layers.step]}
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be None, a slice or a sequence of ints, got {layers!r}")
    out = list(layers)
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"layer indices must be ints, got {i!r} in {layers!r}")
    return out


def _layer_indices(layers: Any, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
    if isinstance(layers, slice):
        idx = list(range(n_layers))[layers]
    else:
        idx = []
        for i in layers:
            if not -n_layers <= i < n_layers:
                raise ValueError(f"layer index {i} out of range for a model with {n_layers} layers")
            idx.append(i % n_layers)
    if not idx:
        raise ValueError(f"layers {layers!r} selects no layer of the model's {n_layers}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"layers {layers!r} selects a layer twice")
    return idx


def _tokens(tokenizer: Any, seq_len: int) -> tuple[list[int], int]:
    """The first ``seq_len`` token ids of the corpus, repeating it when it is too short."""
    repeats = 1
    while True:
        ids = list(tokenizer(corpus_text(repeats))["input_ids"])
        if len(ids) >= seq_len:
            return ids[:seq_len], repeats
        per_copy = max(len(ids) // repeats, 1)
        repeats = max(repeats + 1, -(-seq_len // per_copy) + 1)


# --------------------------------------------------------------------------------------------------
# the capture


def _config_dims(cfg: Any) -> tuple[int, int, int, int]:
    n_layers = int(cfg.num_hidden_layers)
    q_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads)
    return n_layers, q_heads, kv_heads, head_dim


def _decoder(net: Any) -> Any:
    inner = net.get_decoder() if hasattr(net, "get_decoder") else getattr(net, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise ValueError(
            f"unsupported architecture {type(net).__name__}: expected a decoder with `.layers` and a "
            "shared `.rotary_emb` (Llama-style)"
        )
    return inner


#: positions of the LM head computed at a time for the loss (a block of ``(positions, vocab)`` fp32 logits)
HEAD_BLOCK = 256


def lm_logits(net: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's logits of final hidden states ``hidden`` ``(..., hidden_size)`` → ``(..., vocab)``:
    its LM head, then its final logit soft-capping where the config has one (Gemma 2/3), as the model's own
    forward computes them.

    Raises:
        ValueError: the config scales logits in a way this function does not reproduce (``logit_scale``,
            ``logits_scaling``).
    """
    cfg = net.config
    for name in ("logit_scale", "logits_scaling"):
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            raise ValueError(f"unsupported architecture {type(net).__name__}: its logits are scaled ({name})")
    logits = net.lm_head(hidden)
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _loss_backward(net: Any, hidden: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of ``ids`` ``(1, T)`` from ``hidden`` ``(1, T, hidden_size)``,
    back-propagated into the model's graph; the LM head runs :data:`HEAD_BLOCK` positions at a time."""
    h = hidden.detach().requires_grad_(True)
    targets = ids[0, 1:]
    n = int(targets.shape[0])
    total = 0.0
    for a in range(0, n, HEAD_BLOCK):
        b = min(a + HEAD_BLOCK, n)
        logits = lm_logits(net, h[0, a:b]).float()
        loss = torch.nn.functional.cross_entropy(logits, targets[a:b], reduction="sum") / n
        loss.backward()
        total += float(loss.detach())
    hidden.backward(h.grad)
    return total


def _forward_backward(decoder: Any, net: Any, kwargs: dict[str, Any], ids: torch.Tensor) -> tuple[Any, float]:
    """The decoder's forward with gradients, then the backward pass of the LM loss (:func:`_loss_backward`),
    holding one decoder layer's graph at a time. Returns the decoder's output and the loss (nats).

    A pre-hook on every decoder layer cuts the graph at its input: the layer gets a leaf holding the
    input's values (requiring gradients exactly when the input did), kept with the layer's arguments. The
    last layer's graph is the output's own; the loss's backward pass stops at that layer's input leaf. Each
    earlier layer then runs its forward again from its leaf and arguments (a fresh cache in place of the
    model's, which already holds the keys and values) and back-propagates the gradient its next layer's
    leaf received. A layer's forward runs the same operations on the same values both times, so the
    forward hooks see the same activations again (the K/V hooks give new leaves, which receive the
    gradients), and every gradient is bitwise the one a single backward pass through the whole model
    gives (``tests/unit/test_capture.py``).
    """
    import transformers

    calls: list[tuple[Any, tuple, dict[str, Any], torch.Tensor]] = []

    def cut(module: Any, args: tuple, kw: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        x = args[0] if args else kw["hidden_states"]
        leaf = x.detach().requires_grad_(x.requires_grad)
        if args:
            args = (leaf, *args[1:])
        else:
            kw = {**kw, "hidden_states": leaf}
        calls.append((module, args, kw, leaf))
        return args, kw

    handles = [layer.register_forward_pre_hook(cut, with_kwargs=True) for layer in decoder.layers]
    try:
        with torch.enable_grad():
            out = decoder(**kwargs)
    finally:
        for h in handles:
            h.remove()
    with torch.enable_grad():
        loss = _loss_backward(net, out.last_hidden_state, ids)
        for j in range(len(calls) - 2, -1, -1):
            grad = calls[j + 1][3].grad
            if grad is None:  # no layer from here down has a K/V leaf: nothing more to back-propagate
                break
            module, args, kw, _ = calls[j]
            kw = {k: transformers.DynamicCache() if isinstance(v, transformers.Cache) else v for k, v in kw.items()}
            y = module(*args, **kw)
            (y[0] if isinstance(y, tuple) else y).backward(grad)
            calls[j + 1] = (None, (), {}, calls[j + 1][3])  # the next layer's arguments are no longer needed
    return out, loss


def _cache_kwarg(fn: Any) -> str:
    """The cache argument's name of a model's ``forward`` (transformers >= 5 calls it ``cache``)."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)  # transformers >= 5 renamed `past_key_values` to `cache`
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("the model returned no KV cache (use_cache=True was ignored)")
    return cache


def _cached_kv(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers ≥ 4.56: DynamicCache.layers[i].keys / .values
        return layers[i].keys, layers[i].values
    if hasattr(cache, "key_cache"):  # older DynamicCache
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]  # legacy tuple of (k, v)


def _kind(cfg: Any, layer: int) -> Any:
    """The layer's type where the config has several (``sliding_attention`` …), else ``None``."""
    types = getattr(cfg, "layer_types", None)
    return types[layer] if types is not None and isinstance(types[layer], str) else None


def _rope_tables(rope: list[tuple[Any, torch.Tensor, torch.Tensor]], layer_types: Any,
                 idx: list[int]) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer type (or None): (cos, sin)}`` from the rotary embedding's calls of one forward pass, each
    ``(seq_len, head_dim)`` fp32; every selected layer's type must have its table."""
    tables = {kind: (c[0].float(), s[0].float()) for kind, c, s in rope}
    if len(tables) != len(rope) or not tables:
        raise ValueError(f"expected one call of the model's rotary embedding per layer type, saw {len(rope)}")
    if None in tables:  # one table for every layer
        if len(tables) != 1:
            raise ValueError("the model's rotary embedding was called both with and without a layer type")
        return tables
    missing = {layer_types[i] for i in idx} - set(tables)
    if missing:
        raise ValueError(f"the model's rotary embedding gave no table for the layer types {sorted(missing)}")
    return tables


def _heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """``(1, T, H*D)``, ``(1, T, H, D)`` or ``(1, H, T, D)`` hook output → ``(H, T, D)``.

    A 4-D output is head-first when its second axis has ``H`` and not ``T`` entries (Gemma 3 normalizes
    the heads after moving them first); with ``T == H`` it is read as token-first (Llama, Qwen3)."""
    if x.dim() == 4 and x.shape[1] == n_heads and x.shape[1] != x.shape[2]:
        return x[0]
    t = x.shape[1]
    return x.reshape(1, t, n_heads, head_dim).transpose(1, 2)[0]


def _run_capture(
    ref: _ModelRef, seq_len: int, layers: Any, with_grads: bool, dev: torch.device, dtype: str = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
) -> KVData:
    import transformers

    net, tokenizer = _model_for_capture(ref, str(dev), _torch_dtype(dtype), cache_dir)
    n_layers, q_heads, kv_heads, head_dim = _config_dims(net.config)
    max_pos = getattr(net.config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > int(max_pos):
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's context ({max_pos} positions, max_position_embeddings)"
        )
    idx = _layer_indices(layers, n_layers)
    ids, repeats = _tokens(tokenizer, seq_len)
    decoder = _decoder(net)

    grabbed: dict[tuple[str, int], torch.Tensor] = {}
    rope: list[tuple[Any, torch.Tensor, torch.Tensor]] = []

    def grab(key: tuple[str, int], leaf: bool):
        def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
            if leaf:  # replace the activation by a leaf so its gradient is kept
                output = output.detach().requires_grad_(True)
                grabbed[key] = output
                return output
            grabbed[key] = output.detach()
            return None

        return hook

    def grab_rope(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        kind = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        rope.append((kind, output[0].detach(), output[1].detach()))

    handles = [decoder.rotary_emb.register_forward_hook(grab_rope, with_kwargs=True)]
    try:
        for i in idx:
            attn = getattr(decoder.layers[i], "self_attn", None)
            if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
                raise ValueError(
                    f"unsupported architecture {type(net).__name__}: layer {i} has no self_attn with "
                    "separate q_proj/k_proj/v_proj"
                )
            q_src = getattr(attn, "q_norm", None)
            k_src = getattr(attn, "k_norm", None)
            q_src = attn.q_proj if q_src is None else q_src
            k_src = attn.k_proj if k_src is None else k_src
            handles.append(q_src.register_forward_hook(grab(("q", i), False)))
            handles.append(k_src.register_forward_hook(grab(("k", i), with_grads)))
            handles.append(attn.v_proj.register_forward_hook(grab(("v", i), with_grads)))

        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(seq_len, device=dev)[None],
            "use_cache": True,
            # a plain cache keeps every token of every layer (the model's own would keep only the last
            # window of a sliding-window layer); the values it holds are the same
            _cache_kwarg(decoder.forward): transformers.DynamicCache(),
        }
        loss_nats = None
        if with_grads:
            out, loss_nats = _forward_backward(decoder, net, kwargs, input_ids)
        else:
            with torch.no_grad():
                out = decoder(**kwargs)  # the decoder only: the logits are not needed
        cache = _returned_cache(out)
        del out, kwargs
    finally:
        for h in handles:
            h.remove()
    release_freed()  # the layers' graphs and activations, before the tensors below are assembled

    tables = _rope_tables(rope, getattr(net.config, "layer_types", None), idx)
    for cos_i, _ in tables.values():
        if cos_i.shape != (seq_len, head_dim):
            raise ValueError(
                f"unsupported RoPE: tables of shape {tuple(cos_i.shape)}, expected ({seq_len}, {head_dim}) "
                "(partial-rotary models are not supported)"
            )
    kinds = [None if None in tables else _kind(net.config, i) for i in idx]
    cos = torch.stack([tables[kind][0] for kind in kinds]).contiguous()
    sin = torch.stack([tables[kind][1] for kind in kinds]).contiguous()

    # each layer's tensors are copied into the stacked outputs and their sources dropped as they go, so the
    # hooks' activations and the stacked copies are not all held at once
    n, f32 = len(idx), torch.float32
    k, v, k_pre = (torch.empty(n, kv_heads, seq_len, head_dim, dtype=f32, device=dev) for _ in range(3))
    q = torch.empty(n, q_heads, seq_len, head_dim, dtype=f32, device=dev)
    kg2, vg2 = (torch.empty_like(k) for _ in range(2)) if with_grads else (None, None)
    for j, i in enumerate(idx):
        k_c, v_c = _cached_kv(cache, i)
        if tuple(k_c.shape) != (1, kv_heads, seq_len, head_dim):
            raise ValueError(
                f"cached keys of layer {i} have shape {tuple(k_c.shape)}, expected "
                f"(1, {kv_heads}, {seq_len}, {head_dim})"
            )
        k[j], v[j] = k_c[0].detach().float(), v_c[0].detach().float()
        k_pre[j] = _heads(grabbed[("k", i)].detach().float(), kv_heads, head_dim)
        q[j] = apply_rope(_heads(grabbed.pop(("q", i)).float(), q_heads, head_dim)[None], cos[j], sin[j])[0]
        if with_grads:
            for src, dst in ((("k", i), kg2), (("v", i), vg2)):
                grad = grabbed[src].grad
                g = torch.zeros_like(grabbed[src]) if grad is None else grad
                dst[j] = _heads(g.detach().float(), kv_heads, head_dim).square()
        grabbed.pop(("k", i), None), grabbed.pop(("v", i), None)
    del cache
    rope_err = max(float((apply_rope(k_pre[j:j + 1], cos[j], sin[j]) - k[j:j + 1]).abs().max())
                   for j in range(len(idx)))
    # fp32: rounding only; bf16/fp16: the model rotates in its own dtype, we rotate its (rounded) k_proj
    # output in fp32, so a few units of the dtype's epsilon apart
    tol = max(1e-4, 4 * torch.finfo(_torch_dtype(dtype)).eps) * (1.0 + float(k.abs().max()))
    if not rope_err <= tol:
        raise ValueError(
            f"unsupported positional encoding: rotating the k_proj output with the model's cos/sin does "
            f"not reproduce the cached keys (max abs error {rope_err:.3g} > {tol:.3g}); only rotate-half "
            "RoPE over the full head is supported"
        )
    text_sha = hashlib.sha256(corpus_text(repeats).encode("utf-8")).hexdigest()
    meta = {
        "model": ref.name,
        "model_file": ref.gguf_file,
        "architecture": type(net).__name__,
        "n_layers": n_layers,
        "layers": idx,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "seq_len": seq_len,
        "text": "kvqbench/data/corpus.txt",
        "corpus_sha256": corpus_sha256(),
        "corpus_repeats": repeats,
        "text_sha256": text_sha,
        "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "k_pre_source": "k_norm" if getattr(decoder.layers[idx[0]].self_attn, "k_norm", None) is not None
        else "k_proj",
        "rope_max_abs_err": rope_err,
        "layer_types": kinds,
        "sliding_window": getattr(net.config, "sliding_window", None),
        "with_grads": with_grads,
        "lm_loss_nats": loss_nats,
        "dtype": "float32",
        "capture_dtype": dtype,
        "device_type": dev.type,
        "attn_implementation": getattr(net.config, "_attn_implementation", None),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    return KVData("real", k, v, q, k_pre=k_pre, cos=cos, sin=sin, k_grad2=kg2, v_grad2=vg2, meta=meta)

